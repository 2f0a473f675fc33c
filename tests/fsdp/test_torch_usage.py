"""How scripts use a sharded model around its steps (clipping, a gradient scaler, a
second forward method, per-unit accumulation flags, up-front unshards, slices, memory
formats), each with parity against torch's ``fully_shard``.

The scenarios, with their assertions, are in ``bodies_torch_usage``: one world-2 launch.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, launched, names
from tests.fsdp.bodies_torch_usage import SCENARIOS


@pytest.fixture(scope="module")
def outcomes() -> Outcomes:
    return launched("tests.fsdp.bodies_torch_usage", world_size=2, timeout=240)


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_fsdp_torch_usage(outcomes: Outcomes, name: str) -> None:
    check(outcomes, name)
