"""The ``"cadence"`` serializer path on each supported torch's compiler internals.

`cadence.precompiling._torch_aot` knows two shapes of torch's internals, 2.13's and
2.15's (see its [Note: precompile serializer paths]); these tests pin what each shape
changes, selected by what the installed torch has, never by its version string.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch
from torch._dynamo import aot_compile as aot_mod
from torch._dynamo import guards

import cadence
from cadence.precompiling import _torch_aot
from cadence.precompiling._errors import PrecompileError
from tests.precompiling._bodies import BACKEND

pytestmark = pytest.mark.filterwarnings("ignore:Cannot locate reference")

# torch 2.15's guard pickler swaps pruned lists and dicts for a persistent id.
PRUNES_CONTAINERS = "persistent_id" in guards.GuardsStatePickler.__dict__
HAS_HEADER = hasattr(aot_mod, "_AOT_COMPILE_MAGIC")


class _Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        # No guard reads it, and a generator holds a live frame no pickler can rebuild.
        self.pending = [(i for i in range(3))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _sum_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def test_every_supported_torch_takes_the_cadence_path() -> None:
    assert _torch_aot.SERIALIZER == "cadence", _torch_aot.SERIALIZER_REASON


def test_the_artifact_starts_with_the_header_torchs_loader_checks(tmp_path: Path) -> None:
    compiled = cadence.precompile(
        _sum_step, (torch.nn.Linear(4, 2), torch.randn(3, 4)), backend=BACKEND
    )
    data = _torch_aot.serialize(compiled._variants[0].aot)  # type: ignore[attr-defined]
    header = _torch_aot.payload_header()
    assert data.startswith(header) and len(header) == (7 if HAS_HEADER else 0)
    # What follows the header is one plain pickle, which torch's own loader reads.
    assert pickle.loads(data[len(header) :])["backend_id"]
    loaded = _torch_aot.deserialize(data)
    x = torch.randn(3, 4)
    model = torch.nn.Linear(4, 2)
    assert torch.equal(_torch_aot.call(loaded, (model, x), {}), _sum_step(model, x))


@pytest.mark.skipif(not PRUNES_CONTAINERS, reason="torch 2.13's guard pickler walks the list")
def test_an_unguarded_attribute_list_is_pruned_not_pickled() -> None:
    model = _Holder()
    compiled = cadence.precompile(_sum_step, (model, torch.randn(3, 4)), backend=BACKEND)
    x = torch.randn(3, 4)
    assert torch.equal(compiled(model, x), _sum_step(model, x))


@pytest.mark.skipif(PRUNES_CONTAINERS, reason="torch 2.15 prunes the list (test above)")
def test_on_torch_2_13_an_unpicklable_attribute_is_refused_with_its_path() -> None:
    with pytest.raises(PrecompileError, match=r"generator.*local_scope\['model'\]\.pending"):
        cadence.precompile(_sum_step, (_Holder(), torch.randn(3, 4)), backend=BACKEND)


def test_the_guards_pickler_delegates_torchs_persistent_ids() -> None:
    torch_pickler = guards.GuardsStatePickler(
        {}, {}, {}, *([{}] if PRUNES_CONTAINERS else []), io.BytesIO()
    )
    ours = _torch_aot._GuardsPickler(torch_pickler, io.BytesIO())
    if PRUNES_CONTAINERS:
        assert ours.persistent_id == torch_pickler.persistent_id
    else:
        assert "persistent_id" not in vars(ours)
