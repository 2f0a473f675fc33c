"""nn.Module methods applied after `cadence.DataParallel` wrapped a model.

- Methods that keep the parameters' dtype and device (``to_empty(device=<the same>)``,
  ``cpu()``/``to("cpu")`` on a CPU model, ``float()`` on a float model, ``_apply``,
  also on a submodule) are honoured: training matches one process on the global
  batch, and buffers these methods replaced are still broadcast from rank 0 at every
  forward (a rank-local change is undone).
- A dtype or device change (``to(dtype)``, ``double``/``half``/``bfloat16``,
  ``to_empty`` onto another device) is refused before anything changes, naming the
  method and the fix; training then continues as if it had not been called.
- ``load_state_dict(assign=True)`` on the wrapper is refused the same way.
- A change made on the inner module, where the wrapper does not see it happen
  (``load_state_dict(assign=True)``, a dtype conversion, ``requires_grad_`` either way
  after wrapping), is refused by the next training step, naming the parameter and
  the fix: each would otherwise leave gradients unreduced (unfreezing did, silently)
  or reduced into buckets built for other tensors.
- `cadence.DataParallel` is not a ``torch.nn.parallel.DistributedDataParallel``
  (docs/data_parallel.md says why).
"""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.dp.bodies_module_methods import HONOURED, REFUSED, module_methods_body

TOL = 1e-6


@pytest.fixture(scope="module")
def rank0() -> dict[str, Any]:
    return run_distributed(module_methods_body, world_size=2, timeout=240)[0]


def _case(entry: Any) -> dict[str, Any]:
    """A case's results; a case that raised left its exception's text instead."""
    assert isinstance(entry, dict), entry
    return entry


@pytest.mark.parametrize("order", ["before_training", "after_a_step"])
@pytest.mark.parametrize("method", list(HONOURED))
def test_method_keeping_dtype_and_device_is_honoured(
    rank0: dict[str, Any], method: str, order: str
) -> None:
    case = _case(rank0["honoured"][f"method={method!r},order={order!r}"])
    assert case["losses"][0] != case["losses"][-1], case
    assert case["vs_single"] <= TOL, case
    assert case["spread"] == 0.0, case  # parameters and buffers equal on every rank


@pytest.mark.parametrize("method", [m for m, (_, where, _) in REFUSED.items() if where == "call"])
def test_method_changing_what_buckets_hold_is_refused_before_anything_changes(
    rank0: dict[str, Any], method: str
) -> None:
    case = _case(rank0["refused"][f"method={method!r}"])
    assert case["message"] == "ok", case["message"]
    assert case["unchanged"], case
    assert case["spread_after"] == 0.0, case


@pytest.mark.parametrize("method", [m for m, (_, where, _) in REFUSED.items() if where == "step"])
def test_change_behind_the_wrappers_back_is_refused_by_the_next_step(
    rank0: dict[str, Any], method: str
) -> None:
    case = _case(rank0["refused"][f"method={method!r}"])
    assert case["message"] == "ok", case["message"]


def test_not_a_torch_ddp_instance(rank0: dict[str, Any]) -> None:
    assert _case(rank0["isinstance"])["is_ddp"] is False
