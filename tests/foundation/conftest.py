"""One world-4 launch serves the topology tests and the ``group=`` tests."""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.foundation import bodies_topology


@pytest.fixture(scope="package")
def world4() -> list[dict[str, Any]]:
    return run_distributed(bodies_topology.world4, world_size=4, timeout=120)
