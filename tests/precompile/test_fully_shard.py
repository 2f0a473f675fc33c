"""precompile_module on a fully_shard model at world 2: the artifact travels to rank 1.

fully_shard's dynamic ``FullyShard<Cls>`` classes are found by name in the receiving
process (torch's serialized guards pickle the module's class by reference), so rank 1
loads rank 0's compile instead of failing a class-identity guard.
"""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.precompile._fsdp_bodies import fully_shard_body

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    cache = tmp_path_factory.mktemp("fsdp_precompile") / "cache"
    return run_distributed(fully_shard_body, str(cache), world_size=2, timeout=240)


def test_one_compile_received_by_the_other_rank(results: list[dict[str, Any]]) -> None:
    assert [r["compiles"] for r in results] == [1, 0]
    assert [r["source"] for r in results] == ["compiled", "received"]
    assert results[0]["class"] == "FullyShardTinyNet"


def test_first_step_matches_eager(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["grad_diffs"][0] < 1e-6, r


@pytest.mark.xfail(
    strict=True,
    reason="known bug: the precompiled forward of a fully_shard root keeps computing with "
    "the parameter values it was compiled with (the loss is the same at every step, on "
    "both ranks, so not a transfer problem); the unsharded parameters are views into one "
    "flat buffer whose storage is freed and refilled each step",
)
def test_later_steps_match_eager(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert max(r["grad_diffs"]) < 1e-6 and r["param_diff"] < 1e-6, r
