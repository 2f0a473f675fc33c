"""One world-2 launch serves every world-2 DataParallel test module."""

from __future__ import annotations

import pytest

from cadence.testing import run_distributed
from tests._scenarios import Outcomes, merged
from tests.data_parallel.bodies_world2 import world2 as world2_body


@pytest.fixture(scope="package")
def world2() -> dict[str, Outcomes]:
    """``{bodies module: {scenario: None, or its traceback on the ranks it failed}}``."""
    ranks = run_distributed(world2_body, world_size=2, timeout=240)
    return {part: merged([r[part] for r in ranks]) for part in ranks[0]}
