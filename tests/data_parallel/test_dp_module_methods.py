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

The scenarios, with their assertions, are in ``bodies_module_methods``; one world-2
launch runs them all.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, launched, names
from tests.data_parallel.bodies_module_methods import SCENARIOS


@pytest.fixture(scope="module")
def outcomes() -> Outcomes:
    return launched("tests.data_parallel.bodies_module_methods", world_size=2, timeout=240)


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_module_method(outcomes: Outcomes, name: str) -> None:
    check(outcomes, name)
