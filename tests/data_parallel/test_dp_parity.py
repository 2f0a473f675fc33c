"""DataParallel parity: single-process training on the concatenated batch, and torch DDP.

The scenarios, with their assertions, are in ``bodies_parity``; world 2 runs in the
shared launch of ``conftest``, worlds 1, 3 and 4 in a launch each.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, launched, names
from tests.data_parallel.bodies_parity import OTHER_WORLDS, SCENARIOS


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_parity_world2(world2: dict[str, Outcomes], name: str) -> None:
    check(world2["parity"], name)


@pytest.fixture(scope="module", params=[1, 3, 4], ids=lambda w: f"world{w}")
def other_world(request: pytest.FixtureRequest) -> Outcomes:
    return launched(
        "tests.data_parallel.bodies_parity", "OTHER_WORLDS", world_size=request.param, timeout=150
    )


@pytest.mark.parametrize("name", names(OTHER_WORLDS))
def test_parity_other_world_sizes(other_world: Outcomes, name: str) -> None:
    check(other_world, name)
