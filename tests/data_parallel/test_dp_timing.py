"""Collective counts, accumulation, reentrant checkpointing, buffers, dtypes and hooks.

The scenarios, with their assertions, are in ``bodies_timing``; the world-2 launch of
``conftest`` runs them.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, names
from tests.data_parallel.bodies_timing import SCENARIOS


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_timing(world2: dict[str, Outcomes], name: str) -> None:
    check(world2["timing"], name)
