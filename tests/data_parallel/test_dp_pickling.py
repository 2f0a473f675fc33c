"""A wrapped model pickles and deep-copies as torch DDP's (``torch.save(model)``).

The scenarios, with their assertions, are in ``bodies_pickling``; one world-2 launch.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, launched, names
from tests.data_parallel.bodies_pickling import SCENARIOS


@pytest.fixture(scope="module")
def outcomes() -> Outcomes:
    return launched("tests.data_parallel.bodies_pickling", world_size=2, timeout=120)


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_dp_pickling(outcomes: Outcomes, name: str) -> None:
    check(outcomes, name)
