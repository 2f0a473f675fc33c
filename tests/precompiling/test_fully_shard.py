"""precompile_module on fully_shard models at world 2, one launch for every check.

- A fully_shard root: rank 0 compiles, rank 1 receives (fully_shard's dynamic
  ``FullyShard<Cls>`` classes are found by name in the receiving process, so the
  class-identity guard passes), and several SGD steps match eager fully_shard.
- Nested units (blocks, then the root): precompile_module on the root is refused
  (the blocks' hooks would run inside the graph); on each block it trains in parity.
- ``precompile(step, (model, ...))`` with a fully_shard model (or a module holding
  one) is refused, and so is precompile_module in the middle of a step.
"""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.precompiling._fsdp_bodies import STEPS, fully_shard_body

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOL = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    cache = tmp_path_factory.mktemp("fsdp_precompile") / "cache"
    return run_distributed(fully_shard_body, str(cache), world_size=2, timeout=300)


def _assert_parity(r: dict[str, Any]) -> None:
    assert len(r["losses"]) == STEPS
    # The loss moves: a forward computing with stale (compile-time) values would not.
    assert len(set(r["losses"])) == STEPS, r["losses"]
    assert max(r["loss_diffs"]) <= TOL, r
    assert max(r["grad_diffs"]) <= TOL, r
    assert r["param_diff"] <= TOL, r


def test_one_compile_received_by_the_other_rank(results: list[dict[str, Any]]) -> None:
    roots = [r["root"] for r in results]
    assert [r["compiles"] for r in roots] == [1, 0]
    assert [r["source"] for r in roots] == ["compiled", "received"]
    assert roots[0]["class"] == "FullyShardTinyNet"


def test_module_left_sharded_after_precompile(results: list[dict[str, Any]]) -> None:
    assert all(r["root"]["sharded_after"] for r in results)


def test_later_steps_match_eager(results: list[dict[str, Any]]) -> None:
    for r in results:
        _assert_parity(r["root"])


def test_nested_units_precompiled_per_block_match_eager(results: list[dict[str, Any]]) -> None:
    # One compile per block on rank 0, received by rank 1.
    assert [r["nested"]["block_compiles"] for r in results] == [2, 0]
    for r in results:
        _assert_parity(r["nested"])


def test_root_with_nested_units_refused(results: list[dict[str, Any]]) -> None:
    for r in results:
        msg = r["nested"]["root_refusal"]
        assert "contains fully_shard units (blocks.0, blocks.1)" in msg, msg
        assert "precompile_module each innermost fully_shard module" in msg, msg


def test_function_calling_a_fully_shard_model_refused(results: list[dict[str, Any]]) -> None:
    for r in results:
        msg = r["root"]["call_refusal"]
        assert "argument 0 (FullyShardTinyNet) is a fully_shard module" in msg, msg
        assert "precompile_module(module, example_args)" in msg, msg


def test_container_of_units_passed_to_a_function_refused(results: list[dict[str, Any]]) -> None:
    for r in results:
        msg = r["nested"]["container_refusal"]
        assert "argument 0 (Sequential) contains fully_shard units (0, 0.blocks.0" in msg, msg


def test_precompile_module_mid_step_refused(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert "precompile_module() during forward or backward" in r["root"]["during_forward"]
        assert "handle is still pending" in r["root"]["pending_handle"]
