"""One world-2 launch serves every world-2 DataParallel test module."""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.dp.bodies_world2 import world2 as world2_body


@pytest.fixture(scope="package")
def world2() -> list[dict[str, Any]]:
    return run_distributed(world2_body, world_size=2, timeout=240)
