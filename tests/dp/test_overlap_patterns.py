"""The two overlap patterns that motivate manual finalization, run from ``examples/``.

(a) sparse work runs while the dense all-reduces are in flight, finalized after it;
(b) the dense gradients are finalized and stepped from a hook inside backward. World 2.

Only event order and values are asserted, never durations: the event log puts
collectives and user marks on one clock per rank.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.dp import bodies_overlap


@pytest.fixture(scope="module")
def results(world2: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["overlap"] for r in world2]


def test_a_dense_all_reduce_in_flight_across_the_sparse_work(
    results: list[dict[str, Any]],
) -> None:
    for rank, r in enumerate(results):
        n = r["a"]["buckets"]
        assert n >= 2, "the example should have several buckets"
        for step, o in enumerate(r["a"]["order"]):
            where = f"rank {rank} step {step}"
            # Backward issued every bucket (by log order and clock) before the sparse
            # work began; finalize issued none.
            assert o["issued"] == n, where
            assert o["issued_before_start"] == n, where
            assert o["seq_before_start"] == n, where
            # And none was waited before the sparse work had finished.
            assert o["waited_after_end"] == n, where


def test_a_auto_mode_waits_before_the_sparse_work(results: list[dict[str, Any]]) -> None:
    # The contrast that motivates manual mode: auto mode waits inside backward.
    for r in results:
        assert r["a_auto"]["waited_before_start"] == r["a_auto"]["issued"] > 0


def test_a_matches_single_process_reference(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["a"]["grad"] < 1e-6
        assert r["a"]["param"] < 1e-6


def test_b_finalize_and_step_run_inside_backward(results: list[dict[str, Any]]) -> None:
    for r in results:
        records = r["b"]["records"]
        assert len(records) == bodies_overlap.STEPS
        assert all(rec["in_backward"] and rec["stepped"] for rec in records)
        # Last step's marks: the dense step happened before backward returned.
        assert r["b"]["mark_order"] == ["dense_step_in_backward", "backward_end"]
        assert r["b"]["state_after"] == "idle"


def test_b_matches_single_process_reference(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["b"]["param"] < 1e-6


def test_b_hook_before_every_bucket_launched_raises(results: list[dict[str, Any]]) -> None:
    for r in results:
        msgs = r["b_early"]["messages"]
        n = r["b_early"]["buckets"]
        assert len(msgs) == 1
        assert "buckets have launched" in msgs[0]
        assert f"of {n} buckets" in msgs[0] and f"{n} of {n}" not in msgs[0]
        assert not r["b_early"]["pending"]
