"""The runtime behaviours torch's own FSDP2 tests check (``test_fully_shard_training.py``,
``test_fully_shard_autograd.py``, ``test_fully_shard_comm.py``), each with parity
against torch's ``fully_shard``.

The scenarios, with their assertions, are in ``bodies_torch_runtime``: one world-2
launch, and one world-1 launch for world size 1.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, launched, names
from tests.fsdp.bodies_torch_runtime import SCENARIOS, SCENARIOS_WS1


@pytest.fixture(scope="module")
def outcomes() -> Outcomes:
    return launched("tests.fsdp.bodies_torch_runtime", world_size=2, timeout=240)


@pytest.fixture(scope="module")
def outcomes_ws1() -> Outcomes:
    return launched("tests.fsdp.bodies_torch_runtime", "SCENARIOS_WS1", world_size=1, timeout=120)


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_fsdp_torch_runtime(outcomes: Outcomes, name: str) -> None:
    check(outcomes, name)


@pytest.mark.parametrize("name", names(SCENARIOS_WS1))
def test_fsdp_torch_runtime_ws1(outcomes_ws1: Outcomes, name: str) -> None:
    check(outcomes_ws1, name)
