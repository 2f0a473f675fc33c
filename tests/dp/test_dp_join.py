"""``DataParallel.join()`` (uneven inputs) against torch DDP's, and its refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cadence.testing import run_distributed
from tests.dp.bodies_join import join_suite


@pytest.fixture(scope="module")
def suite() -> list[dict[str, Any]]:
    return run_distributed(join_suite, world_size=3, timeout=120)


def _cases(suite: list[dict[str, Any]], key: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """(label, [result of each participating rank]) for each sub-case of ``key``."""
    labels = suite[0][key]
    return [
        (label, [s[key][label] for s in suite if s[key][label] is not None]) for label in labels
    ]


@pytest.mark.parametrize("key", ["parity", "hooks"])
def test_parity_with_ddp_join(suite: list[dict[str, Any]], key: str) -> None:
    cases = _cases(suite, key)
    assert len(cases) == {"parity": 16, "hooks": 8}[key]
    for label, ranks in cases:
        assert len(ranks) == (2 if "world=2" in label else 3), label
        for r in ranks:
            # Same parameters and buffers as torch DDP's join() on the same batches.
            assert r["vs_ddp"] <= 1e-6, (label, r["vs_ddp"])
            # Every rank, active or joined, issues one all-reduce per bucket per step of
            # the rank with the most batches, as DDP (counted by its comm hook).
            steps = r["max_batches"] * r["num_buckets"]
            if key == "hooks":  # counted by the hooks (torch's bypasses the event log)
                assert r["dp_hook_calls"] == r["ddp_hook_calls"] == steps, (label, r)
            if "hook='torch'" not in label:
                assert r["grad_all_reduces"] == r["ddp_hook_calls"] == steps, (label, r)
            unused = "find_unused=True" in label
            assert r["used_map_all_reduces"] == (r["max_batches"] if unused else 0), (label, r)
            # Per step: the sync flag, plus the source-rank pick with buffers; then one
            # source-rank pick for the final model broadcast.
            per_step = 2 if "buffers=True" in label else 1
            assert r["join_all_reduces"] == r["max_batches"] * per_step + 1, (label, r)
            # Joined ranks shadowed exactly the active ranks' collectives.
            assert r["signature"] == ranks[0]["signature"], label
            # The final model is the same on every rank (buffers too when broadcast).
            assert torch.equal(r["params"], ranks[0]["params"]), label
            if "buffers=True" in label:
                assert torch.equal(r["buffers"], ranks[0]["buffers"]), label


def test_divide_by_initial_world_size_changes_the_result(suite: list[dict[str, Any]]) -> None:
    # Not a vacuous flag: averaging over the active ranks gives other parameters.
    ranks = [s["parity"] for s in suite]
    a = ranks[0]["world=3,buffers=True,find_unused=False,divide=True"]["params"]
    b = ranks[0]["world=3,buffers=True,find_unused=False,divide=False"]["params"]
    assert (a - b).abs().max() > 1e-4


def test_throw_on_early_termination(suite: list[dict[str, Any]]) -> None:
    for label, ranks in _cases(suite, "throw"):
        for rank, r in enumerate(ranks):
            # Every rank raised after the one step they all had, as torch DDP.
            assert r["dp_steps"] == r["ddp_steps"] == 1, (label, r)
            assert r["dp_raised"] and r["ddp_raised"], (label, r)
            expected = "exhausted all inputs" if rank == 0 else "exhausted inputs"
            assert expected in r["dp_raised"], (label, r)
            assert r["vs_ddp"] <= 1e-6, (label, r)
            # The join is left after the exception: no bookkeeping, no_sync allowed.
            assert r["join_all_reduces_after"] == 0, (label, r)


def test_enable_false_is_a_no_op(suite: list[dict[str, Any]]) -> None:
    for s in suite:
        r = s["disabled"]
        assert r["vs_ddp"] <= 1e-6, r
        assert r["join_all_reduces"] == 0, r
        assert r["grad_all_reduces"] == r["ddp_hook_calls"] == 1, r


def test_generic_join_with_zero_redundancy_optimizer(suite: list[dict[str, Any]]) -> None:
    for s in suite:
        r = s["generic_zero"]
        assert r["vs_ddp"] <= 1e-6, r
        assert r["grad_all_reduces"] == r["ddp_hook_calls"] == 5, r
        assert torch.equal(r["params"], suite[0]["generic_zero"]["params"])


@pytest.mark.parametrize(
    "case",
    [
        "manual",
        "left_after_refusal",
        "manual_inside",
        "static_graph",
        "set_static_graph_inside",
        "no_sync_inside",
        "grad_sync_off_inside",
        "grad_sync_off_at_entry",
        "no_sync_at_entry",
        "split_backward_inside",
        "unknown_option",
        "divide_not_first",
        "divide_with_comm_hook",
        "no_collectives",
    ],
)
def test_refusals(suite: list[dict[str, Any]], case: str) -> None:
    for s in suite:
        assert s["refusals"][case] == "ok", s["refusals"][case]
