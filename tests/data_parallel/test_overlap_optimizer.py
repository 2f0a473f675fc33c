"""`DataParallel.overlap_optimizer`: each bucket stepped as its reduction completes. World 2.

- Parameters and optimizer state after N steps are bitwise those of the plain
  ``backward(); step(); zero_grad()`` loop with a StepLR schedule, for SGD (momentum,
  weight decay), Adam and AdamW, each foreach, single-tensor and fused.
- The same under accumulation (``no_sync()``, ``require_backward_grad_sync``), a bf16
  wire, ``gradient_as_bucket_view``, a checkpoint round trip, global-norm clipping
  (``max_grad_norm``), manual finalization (blocking, a handle, or left to
  ``opt.step()``), and an optimizer holding parameters outside the wrapper or not
  holding some of its own.
- Stepping is early: by event order on one clock, each bucket is stepped after its own
  all-reduce was waited, while the next one is issued and not yet waited, and before
  backward returns.
- Hooks and schedulers see one step per ``opt.step()``; refusals name cause and fix.

Only event order and values are asserted, never durations. The scenarios, with their
assertions, are in ``bodies_overlap_optimizer``; one world-2 launch runs them all.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, launched, names
from tests.data_parallel.bodies_overlap_optimizer import SCENARIOS


@pytest.fixture(scope="module")
def outcomes() -> Outcomes:
    return launched("tests.data_parallel.bodies_overlap_optimizer", world_size=2, timeout=240)


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_overlap_optimizer(outcomes: Outcomes, name: str) -> None:
    check(outcomes, name)
