"""The behaviours torch's own CPU DDP tests check (``test_c10d_gloo.py``,
``test_c10d_common.py``), each with parity against DDP.

The scenarios, with their assertions, are in ``bodies_c10d``; one world-2 launch.
The list that maps each torch test to its scenario is in ``docs/torch-suite.md``.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, launched, names
from tests.data_parallel.bodies_c10d import SCENARIOS


@pytest.fixture(scope="module")
def outcomes() -> Outcomes:
    return launched("tests.data_parallel.bodies_c10d", world_size=2, timeout=180)


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_dp_c10d(outcomes: Outcomes, name: str) -> None:
    check(outcomes, name)
