"""One world-2 launch serves the parity, semantics and checkpoint-save tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.fsdp.bodies_world2 import world2 as world2_body


@pytest.fixture(scope="package")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the world-2 run saves the checkpoint that world 4 loads."""
    return tmp_path_factory.mktemp("dcp")


@pytest.fixture(scope="package")
def world2(dcp_dir: Path) -> list[dict[str, Any]]:
    return run_distributed(world2_body, str(dcp_dir / "ws2"), world_size=2, timeout=240)
