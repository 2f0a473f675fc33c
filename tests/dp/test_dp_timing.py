"""Collective counts, accumulation, reentrant checkpointing, buffers, dtypes and hooks."""

from __future__ import annotations

from typing import Any

import pytest

from tests.dp.bodies_timing import ACCUMULATION


@pytest.fixture(scope="module")
def suite(world2: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["timing"] for r in world2]


@pytest.fixture(scope="module")
def counts(suite: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["counts"] for r in suite]


def test_synced_step_issues_one_all_reduce_per_bucket(counts: list[dict[str, Any]]) -> None:
    r = counts[0]
    assert r["buckets"] == 5
    assert r["auto"] == r["buckets"]


def test_manual_mode_launches_in_backward_and_matches_auto_order(
    counts: list[dict[str, Any]],
) -> None:
    for r in counts:
        # Launched during backward, before finalize; finalize adds none.
        assert r["manual_before_finalize"] == r["buckets"]
        assert r["manual"] == r["buckets"]
        assert r["manual_sig"] == r["auto_sig"]
    # The same collectives in the same order on every rank.
    assert counts[0]["auto_sig"] == counts[1]["auto_sig"]


def test_finalize_with_nothing_pending_is_a_noop(counts: list[dict[str, Any]]) -> None:
    assert counts[0]["finalize_nothing"] is None
    assert counts[0]["finalize_nothing_count"] == 0


def test_accumulation_reduces_exactly_once(counts: list[dict[str, Any]]) -> None:
    r = counts[0]
    assert r["no_sync"] == 0
    assert r["accum_total"] == r["buckets"]
    assert r["deferred_before"] == 0
    assert r["deferred"] == r["buckets"]


def test_find_unused_adds_one_used_map_all_reduce(counts: list[dict[str, Any]]) -> None:
    r = counts[0]
    assert r["unused_count"] == r["unused_buckets"] + 1
    assert r["unused_grad_none"], "a globally unused parameter must keep .grad=None (as DDP)"


def test_unused_on_one_rank_matches_ddp_and_launch_order(suite: list[dict[str, Any]]) -> None:
    r = [rank["unused_on_one_rank"] for rank in suite]
    assert r[0]["diff"] < 1e-7 and r[1]["diff"] < 1e-7
    assert r[1]["b_grad_set"] == 1.0  # used on rank 0, so rank 1 gets the average too
    assert r[0]["sig"] == r[1]["sig"]


@pytest.fixture(scope="module")
def accumulation(suite: list[dict[str, Any]]) -> dict[str, float]:
    return suite[0]["accumulation"]


@pytest.mark.parametrize("kind", ACCUMULATION)
def test_accumulation_matches_reference(accumulation: dict[str, float], kind: str) -> None:
    assert accumulation[kind] < 1e-6


@pytest.fixture(scope="module")
def reentrant(suite: list[dict[str, Any]]) -> dict[str, Any]:
    return suite[0]["reentrant"]


def test_static_graph_handles_a_layer_checkpointed_twice(reentrant: dict[str, Any]) -> None:
    assert reentrant["static_step0"] < 1e-6  # learning step (no overlap)
    assert reentrant["static_step1"] < 1e-6  # learned counts


def test_hook_firing_twice_names_the_parameter(reentrant: dict[str, Any]) -> None:
    assert reentrant["twice_error"] == "ok"


def test_reentrant_checkpointed_head_finalizes_after_outer_backward(
    reentrant: dict[str, Any],
) -> None:
    assert reentrant["ckpt_head"] < 1e-6
    assert reentrant["ckpt_head_state"] == "idle"


def test_parameters_and_buffers_broadcast_from_rank0(suite: list[dict[str, Any]]) -> None:
    for r in (rank["buffers"] for rank in suite):
        assert r["init_diff"] == 0.0
        assert r["buffer_diff"] == 0.0


def test_wire_dtypes_and_comm_hooks(suite: list[dict[str, Any]]) -> None:
    r = suite[0]["wire"]
    for name in ("reduce_dtype_bf16", "bf16_hook", "fp16_hook", "allreduce_hook"):
        assert r[name + "_dtype_ok"] == 1.0, name  # .grad keeps fp32
        assert r[name + "_count"] == 1.0, name  # counted through cadence.Comm
    assert r["allreduce_hook"] < 1e-6
    assert r["torch_hook"] < 1e-6  # a torch DDP hook runs unchanged
    assert 0 < r["reduce_dtype_bf16"] < 1e-2  # bf16 rounding, but close
    assert 0 < r["fp16_hook"] < 1e-3
