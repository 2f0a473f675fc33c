"""``DataParallel.join()`` (uneven inputs) against torch DDP's, and its refusals.

The scenarios, with their assertions, are in ``bodies_join``; one world-3 launch runs
them all.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, launched, names
from tests.data_parallel.bodies_join import HOOKS, PARITY, SCENARIOS


@pytest.fixture(scope="module")
def outcomes() -> Outcomes:
    return launched("tests.data_parallel.bodies_join", world_size=3, timeout=120)


def test_parity_grids() -> None:
    # Every combination of world, buffer sync, unused parameters and divide; with hooks,
    # of world, unused parameters and hook.
    assert (len(PARITY), len(HOOKS)) == (16, 8)


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_join(outcomes: Outcomes, name: str) -> None:
    check(outcomes, name)
