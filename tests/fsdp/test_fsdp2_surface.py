"""cadence.fully_shard takes torch FSDP2's arguments, policies and setters."""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.fsdp.bodies_fsdp2_surface import fsdp2_surface


@pytest.fixture(scope="module")
def surface() -> list[dict[str, Any]]:
    return run_distributed(fsdp2_surface, world_size=2, timeout=240)


def test_mesh_matches_fsdp2(surface: list[dict[str, Any]]) -> None:
    r = surface[0]["mesh"]
    assert r["cadence_parity"] < 1e-5 and r["fsdp2_parity"] < 1e-5, r
    assert tuple(r["cadence_counts"]) == tuple(r["fsdp2_counts"]), r


def test_torch_mixed_precision_policy(surface: list[dict[str, Any]]) -> None:
    r = surface[0]["torch_mp"]
    assert r["torch_vs_cadence_policy"] == 0.0, r  # converted field by field
    assert r["torch_policy_vs_fsdp2"] < 1e-2, r  # bf16 compute on both sides
    assert r["wire"] == ["all_gather:bfloat16", "reduce_scatter:float32"], r


@pytest.mark.parametrize(
    "case",
    [
        "mesh_and_group",
        "mesh_type",
        "cpu_offload",
        "raf_int",
        "placement_dim1",
        "dp_mesh_dims",
        "bad_mp",
        "other_offload",
        "all_reduce_in_backward",
    ],
)
def test_refused_arguments(surface: list[dict[str, Any]], case: str) -> None:
    assert surface[0]["arguments"][case] == "ok", surface[0]["arguments"][case]


def test_accepted_arguments(surface: list[dict[str, Any]]) -> None:
    r = surface[0]["arguments"]
    assert r["no_offload_ok"] == 1.0 and r["placement_dim0_ok"] == 1.0, r
    assert r["ignored_is_plain"] == 1.0 and r["ignored_others_sharded"] == 1.0, r
    assert r["ignored_grad_spread"] > 0, r  # an ignored parameter's grad is not reduced
    # Three units + root: forward gathers 4; backward re-gathers the 3 resharded units.
    assert (r["ag_raf_true"], r["ag_raf_false"]) == (7, 4), r


def test_set_is_last_backward(surface: list[dict[str, Any]]) -> None:
    r = surface[0]["is_last_backward"]
    assert r["rs_per_micro"] == [4, 4, 4, 4], r  # every microbatch reduces
    assert r["grad_early"] == "PendingGrad", r  # ... but .grad waits for the last one
    assert r["step_early"] == "ok", r["step_early"]
    assert r["parity"] < 1e-5, r
