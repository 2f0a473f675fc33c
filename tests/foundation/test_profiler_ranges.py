"""cadence's phases as ``torch.profiler`` ranges; the scenarios are in ``bodies_profiler``."""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, launched, names
from tests.foundation.bodies_profiler import SCENARIOS


@pytest.fixture(scope="module")
def outcomes() -> Outcomes:
    return launched("tests.foundation.bodies_profiler", world_size=2, timeout=120)


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_profiler_ranges(outcomes: Outcomes, name: str) -> None:
    check(outcomes, name)
