"""The two overlap patterns that motivate manual finalization, run from ``examples/``.

(a) sparse work runs while the dense all-reduces are in flight, finalized after it;
(b) the dense gradients are finalized and stepped from a hook inside backward. World 2.

Only event order and values are asserted, never durations: the event log puts
collectives and user marks on one clock per rank. The scenarios, with their
assertions, are in ``bodies_overlap``; the world-2 launch of ``conftest`` runs them.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, names
from tests.data_parallel.bodies_overlap import SCENARIOS


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_overlap_pattern(world2: dict[str, Outcomes], name: str) -> None:
    check(world2["overlap"], name)
