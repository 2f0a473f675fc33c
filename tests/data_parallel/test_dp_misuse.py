"""One test per DataParallel misuse error: each names the cause and the fix.

The scenarios, with their assertions, are in ``bodies_misuse``; the world-2 launch of
``conftest`` runs them.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, names
from tests.data_parallel.bodies_misuse import SCENARIOS


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_misuse(world2: dict[str, Outcomes], name: str) -> None:
    check(world2["misuse"], name)
