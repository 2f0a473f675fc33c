"""The checks and policies torch's own FSDP2 tests pin (``test_fully_shard_init.py``,
``_state.py``, ``_training.py``, ``_grad_timing/autograd.py``, and the 2.15 mixed-precision default),
each with parity against torch's ``fully_shard``: same parameters and wire dtypes, or an
error of the same type.

The scenarios, with their assertions, are in ``bodies_torch_checks``; one world-2 launch.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, launched, names
from tests.fsdp.bodies_torch_checks import SCENARIOS


@pytest.fixture(scope="module")
def outcomes() -> Outcomes:
    return launched("tests.fsdp.bodies_torch_checks", world_size=2, timeout=240)


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_fsdp_torch_checks(outcomes: Outcomes, name: str) -> None:
    check(outcomes, name)
