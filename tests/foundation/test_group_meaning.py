"""``group=`` has one meaning on every wrapper (see [Note: the meaning of group=]).

Each accepted form, on DataParallel and on fully_shard, at world 4 with the
topology dp_replicate=2 x dp_shard=2: gradients equal single-process training on
the batches of exactly the ranks the form names, with the expected collectives.
Refusals are raised before any collective, as `cadence.CadenceError`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from torch import nn

import cadence
from cadence.errors import CadenceRuntimeError, CadenceTypeError
from tests.foundation.bodies_topology import FORMS, WRAPPERS

# (ranks averaged over, collectives of one step, placements of a sharded parameter)
FLAT = "(Shard(dim=0),)"
HSDP = "(Replicate(), Shard(dim=0))"
FSDP_FLAT = {"all_gather": 3, "reduce_scatter": 2}  # 2 units; the nested one re-gathers
FSDP_HSDP = {"all_gather": 3, "reduce_scatter": 2, "all_reduce": 2}
EXPECTED = {
    ("dp", "none"): (4, {"all_reduce": 1}, None),
    ("dp", "process_group"): (2, {"all_reduce": 1}, None),
    ("dp", "parallel_groups"): (4, {"all_reduce": 1}, None),  # the flattened dp group
    ("dp", "mesh_1d"): (4, {"all_reduce": 1}, None),
    ("dp", "mesh_2d"): (4, {"all_reduce": 1}, None),  # flattened
    ("fsdp", "none"): (4, FSDP_FLAT, FLAT),
    ("fsdp", "process_group"): (2, FSDP_FLAT, FLAT),
    ("fsdp", "parallel_groups"): (4, FSDP_HSDP, HSDP),  # dp_replicate > 1: HSDP
    ("fsdp", "mesh_1d"): (4, FSDP_FLAT, FLAT),
    ("fsdp", "mesh_2d"): (4, FSDP_HSDP, HSDP),  # (replicate, shard)
}


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("form", FORMS)
def test_each_form_reduces_over_the_named_ranks(
    world4: list[dict[str, Any]], wrapper: str, form: str
) -> None:
    members, counts, placements = EXPECTED[(wrapper, form)]
    for rank, r in enumerate(world4):
        case = r["meaning"][f"wrapper={wrapper!r},form={form!r}"]
        assert case["members"] == members, rank
        assert case["grad_diff"] < 1e-6, (rank, case)
        assert case["control_diff"] > 1e-3, (rank, case)  # a wrong group would show
        assert case["counts"] == counts, (rank, case)
        assert case["placements"] == placements, (rank, case)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_3d_mesh_is_refused(world4: list[dict[str, Any]], wrapper: str) -> None:
    msg = world4[0]["meaning"][f"refuse_3d_{wrapper}"]
    assert msg.startswith("CadenceValueError"), msg
    assert "3-D DeviceMesh" in msg and "2-D mesh (replicate, shard)" in msg


@pytest.mark.parametrize(
    "wrap",
    [
        lambda g: cadence.DataParallel(nn.Linear(2, 2), group=g),
        lambda g: cadence.fully_shard(nn.Linear(2, 2), group=g),
    ],
    ids=["dp", "fsdp"],
)
def test_an_unknown_group_type_is_refused_naming_the_accepted_ones(wrap: Any) -> None:
    # Raised before the process group is even looked at: no rank can be left waiting.
    with pytest.raises(CadenceTypeError) as info:
        wrap("world")
    assert isinstance(info.value, TypeError) and isinstance(info.value, cadence.CadenceError)
    for accepted in ("None", "ProcessGroup", "ParallelGroups", "DeviceMesh"):
        assert accepted in str(info.value)
    assert "got group=str" in str(info.value)


@pytest.mark.parametrize(
    "wrap",
    [lambda: cadence.DataParallel(nn.Linear(2, 2)), lambda: cadence.fully_shard(nn.Linear(2, 2))],
    ids=["dp", "fsdp"],
)
def test_no_process_group_is_refused_with_the_fix(wrap: Any) -> None:
    if dist.is_initialized():  # pragma: no cover - this test process never initialises one
        pytest.skip("a process group exists in the test process")
    with pytest.raises(CadenceRuntimeError, match=r"call cadence.init\(\) first"):
        wrap()
