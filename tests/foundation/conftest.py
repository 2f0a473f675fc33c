"""The foundation tests share one world-3 and one world-4 launch (see ``bodies_world``)."""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.foundation import bodies_world


@pytest.fixture(scope="package")
def world3() -> list[dict[str, Any]]:
    return run_distributed(bodies_world.world3, world_size=3, timeout=150)


@pytest.fixture(scope="package")
def world4() -> list[dict[str, Any]]:
    return run_distributed(bodies_world.world4, world_size=4, timeout=150)
