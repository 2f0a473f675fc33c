"""Manual finalization: ``.grad`` cannot be clipped, stepped on or read before it is reduced.

The scenarios, with their assertions, are in ``bodies_pending_grads``; one world-2
launch runs them all.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, launched, names
from tests.foundation.bodies_pending_grads import SCENARIOS


@pytest.fixture(scope="module")
def outcomes() -> Outcomes:
    return launched("tests.foundation.bodies_pending_grads", world_size=2, timeout=120)


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_pending_grads(outcomes: Outcomes, name: str) -> None:
    check(outcomes, name)
