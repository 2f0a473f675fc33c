"""Every world-2 DataParallel rank body in one launch (process start-up dominates).

The sections are independent: each builds its own models and seeds its own
generators, so their order does not matter.
"""

from __future__ import annotations

from typing import Any

from tests.dp.bodies_misuse import misuse
from tests.dp.bodies_overlap import run_all as overlap
from tests.dp.bodies_parity import CONFIGS, parity_suite
from tests.dp.bodies_timing import timing_suite

__all__ = ["world2"]


def world2() -> dict[str, Any]:
    return {
        "parity": parity_suite(CONFIGS),
        "timing": timing_suite(),
        "misuse": misuse(),
        "overlap": overlap(),
    }
