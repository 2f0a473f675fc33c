"""Every world-2 DataParallel scenario in one launch (process start-up dominates).

The scenarios are independent: each builds its own models and seeds its own
generators, so their order does not matter. One map of outcomes per bodies module.
"""

from __future__ import annotations

from tests import _scenarios
from tests.data_parallel import (
    bodies_embedding,
    bodies_misuse,
    bodies_overlap,
    bodies_parity,
    bodies_timing,
)

__all__ = ["world2"]


def world2() -> dict[str, _scenarios.Outcomes]:
    return {
        "parity": _scenarios.run_scenarios(bodies_parity.SCENARIOS),
        "timing": _scenarios.run_scenarios(bodies_timing.SCENARIOS),
        "misuse": _scenarios.run_scenarios(bodies_misuse.SCENARIOS),
        "overlap": _scenarios.run_scenarios(bodies_overlap.SCENARIOS),
        "embedding": _scenarios.run_scenarios(bodies_embedding.SCENARIOS),
    }
