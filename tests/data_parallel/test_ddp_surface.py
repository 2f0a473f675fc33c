"""DataParallel accepts torch DDP's constructor and attributes, each with its effect.

The scenarios, with their assertions, are in ``bodies_ddp_surface``; one world-2
launch runs them all.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, launched, names
from tests.data_parallel.bodies_ddp_surface import SCENARIOS


@pytest.fixture(scope="module")
def outcomes() -> Outcomes:
    return launched("tests.data_parallel.bodies_ddp_surface", world_size=2, timeout=240)


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_ddp_surface(outcomes: Outcomes, name: str) -> None:
    check(outcomes, name)
