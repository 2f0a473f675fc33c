"""`cadence.gradient_timing`: the shared timing verbs drive torch's DDP and FSDP2.

A specification on every supported torch. Where torch has caller-side finalization
(``finalize_backward``; torch 2.15) the adapter uses it; where it has not (torch
2.13) the adapter keeps each verb's meaning with what torch offers and refuses the
rest. Behaviours that differ are separate tests, each selected by that capability,
read from torch itself; see [Note: driving torch's wrappers with the timing verbs].

Specification:
- ``gradient_timing`` adapts torch's FSDP2 and DDP modules (and returns a cadence
  ``DataParallel`` itself), and detects whether torch finalizes on the caller's side.
- ``set_requires_gradient_sync`` governs the backward that starts after it, even when
  set after the forward; DDP's ``no_sync()`` is still honoured; a flip after the
  forward under DDP's ``static_graph`` is refused, naming when to set it.
- Without torch's finalization, torch finishes the reductions at the end of the
  syncing backward and ``finalize_backward`` has nothing left; with it, manual mode
  leaves them to ``finalize_backward``, whose handle is pending until waited.
- Every backward with sync off, then ``finalize_backward`` with sync on: FSDP2 with
  torch's finalization reduces there (same parameters as the plain loop); otherwise,
  and always for DDP, the finalize and the optimizer step are refused with the fix.
- An unwaited handle holds back the forward, the optimizer step and a second finalize,
  each refused naming the wait.
- ``finalize_backward`` with nothing pending raises nothing, issues no collective, and
  returns ``None`` (blocking) or a completed handle (async).
- ``finalize_backward`` inside a backward is refused naming the fix, except DDP's manual
  mode with torch's finalization once the bucket is ready; either way the caller's
  finalize after backward returns then succeeds.
- ``split_backward`` is refused for torch's wrappers, and a pipeline refuses them
  up front.
"""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests._outcome import assert_refused, assert_returned
from tests.foundation.bodies_torch_timing import (
    TORCH_DDP_FINALIZES,
    TORCH_FSDP2_FINALIZES,
    torch_timing_body,
)

fsdp2_finalizes = pytest.mark.skipif(
    not TORCH_FSDP2_FINALIZES, reason="this torch's FSDP2 has no finalize_backward"
)
fsdp2_lacks_finalize = pytest.mark.skipif(
    TORCH_FSDP2_FINALIZES, reason="this torch's FSDP2 has finalize_backward"
)
ddp_finalizes = pytest.mark.skipif(
    not TORCH_DDP_FINALIZES, reason="this torch's DDP has no finalize_backward"
)
ddp_lacks_finalize = pytest.mark.skipif(
    TORCH_DDP_FINALIZES, reason="this torch's DDP has finalize_backward"
)


@pytest.fixture(scope="module")
def rank0() -> dict[str, Any]:
    return run_distributed(torch_timing_body, world_size=2, timeout=180)[0]


def _pending_handle_holds_everything_back(p: dict[str, Any]) -> None:
    """An unwaited async handle: not done, and a forward, an optimizer step or a second
    finalize are refused, each naming the handle's wait."""
    assert p["done"] is False and p["is_completed"] is False, p
    assert_refused(p["forward"], "has not been waited", "handle.wait()")
    assert_refused(p["step"], "has not been waited")
    assert_refused(p["finalize_again"], "before the previous handle was waited")


def test_adapters_detect_torch_finalization(rank0: dict[str, Any]) -> None:
    assert rank0["fsdp2"]["flags"]["is_timing"]
    assert rank0["fsdp2"]["flags"]["native"] is TORCH_FSDP2_FINALIZES
    assert rank0["ddp"]["native"] is TORCH_DDP_FINALIZES


# -- FSDP2 ---------------------------------------------------------------------


def test_fsdp2_sync_flag_set_after_forward_governs_that_backward(rank0: dict[str, Any]) -> None:
    f = rank0["fsdp2"]["flags"]
    # Per step: [micro 0 backward (sync off), micro 1 backward (sync on), finalize].
    # The no-sync backward reduces nothing; the 4 units reduce once per step.
    assert all(step[0] == 0 and sum(step) == 4 for step in f["rs"]), f
    assert f["parity"] < 1e-5, f


@fsdp2_lacks_finalize
def test_fsdp2_reductions_finished_by_torch_at_end_of_backward(rank0: dict[str, Any]) -> None:
    f = rank0["fsdp2"]["flags"]
    # torch finalized the syncing backward itself: finalize has nothing left.
    assert f["rs"] == [[0, 4, 0], [0, 4, 0]], f
    assert f["pending_at_return"] == [False, False], f


@fsdp2_finalizes
def test_fsdp2_manual_finalize_is_torchs_and_its_handle_pending_until_waited(
    rank0: dict[str, Any],
) -> None:
    f = rank0["fsdp2"]["flags"]
    # In torch's manual mode the units whose post-backward hook does not fire in
    # backward (the first block and the root: their inputs need no gradient) reduce
    # at finalize; the other two during the syncing backward.
    assert f["rs"] == [[0, 2, 2], [0, 2, 2]], f
    assert f["pending_at_return"] == [True, True], f
    assert f["done_after_wait"] == [True, True], f


@fsdp2_lacks_finalize
def test_fsdp2_deferred_reduction_refused_with_the_fix(rank0: dict[str, Any]) -> None:
    d = rank0["fsdp2"]["deferred"]
    assert len(d["finalize"]) == 1, d  # the refusal ends the run
    assert_refused(d["finalize"][0], "accumulated with sync off", "before the last backward")
    assert_refused(d["step_refused"], "never reduced", "run the last backward with sync on")
    assert d["rs"] == [[0, 0]], d  # nothing issued before the refusal


@fsdp2_finalizes
def test_fsdp2_deferred_reduction_runs_at_finalize(rank0: dict[str, Any]) -> None:
    d = rank0["fsdp2"]["deferred"]
    assert d["finalize"] == [None] * 3, d["finalize"]  # each step's finalize returned
    # Every step: no collective in the no-sync backwards, the 4 reduce-scatters at
    # finalize (manual mode async; automatic mode blocking, then async), none at wait.
    assert d["rs"] == [[0, 4]] * 3, d
    assert d["rs_at_wait"] == 0 and d["auto_async_done"] is True, d
    assert d["parity"] < 1e-5, d


@fsdp2_finalizes
def test_fsdp2_async_deferred_reduction_pending_until_waited(rank0: dict[str, Any]) -> None:
    d = rank0["fsdp2"]["deferred"]
    p = d["pending"]
    _pending_handle_holds_everything_back(p)
    assert d["done_after_wait"] is True, d


@pytest.mark.parametrize("mode", ["manual", "auto"])
def test_fsdp2_finalize_with_nothing_pending_issues_nothing(
    rank0: dict[str, Any], mode: str
) -> None:
    n = rank0["fsdp2"]["nothing_pending"][mode]
    # torch's "requires manual finalization" does not escape.
    assert_returned(n["finalize"])
    assert n["blocking"] is None and n["async_done"] is True, n
    assert n["rs"] == 0, n


def test_fsdp2_finalize_with_sync_off_reduces_nothing_and_ends_the_backward(
    rank0: dict[str, Any],
) -> None:
    n = rank0["fsdp2"]["nothing_pending"]["sync_off"]
    assert_returned(n["finalize"])
    assert n["rs"] == 0, n
    assert_returned(n["mode_change"])  # torch no longer holds the manual mode


@pytest.mark.parametrize("mode", ["manual", "auto"])
def test_fsdp2_finalize_inside_backward_refused_with_the_fix(
    rank0: dict[str, Any], mode: str
) -> None:
    i = rank0["fsdp2"]["inside_backward"][mode]
    # torch's FSDP2 finalizes only after backward completes (and in automatic mode
    # only at its end), so a hook cannot be handed reduced gradients.
    assert_refused(i["in_hook"], "inside backward", "after backward returns", "cadence.fully_shard")
    assert_returned(i["after_backward"])


# -- DDP -----------------------------------------------------------------------


def test_ddp_sync_decided_when_backward_starts(rank0: dict[str, Any]) -> None:
    d = rank0["ddp"]
    assert d["ours_is_itself"]
    assert d["ddp_all_reduces"] == 1, d  # one bucket, synced on the last microbatch only
    assert d["parity"] < 1e-6, d  # the same gradients as cadence.DataParallel
    assert d["off_after_forward_all_reduces"] == 0, d
    assert d["on_after_forward_all_reduces"] == 1, d
    assert d["no_sync_all_reduces"] == 0 and d["flag_restored"] is True, d
    # static_graph: DDP's first iterations need the decision at the forward.
    assert_refused(d["flip_after_forward"], "set it before the forward")


def test_ddp_automatic_mode_finalize_has_nothing_left(rank0: dict[str, Any]) -> None:
    d = rank0["ddp"]
    # torch DDP and cadence.DataParallel alike: blocking and async finalize succeed.
    assert d["auto_finalize"] == [None] * 4, d["auto_finalize"]  # none raised
    assert d["auto_finalize_returned"] == [None, True], d
    assert d["auto_finalize_all_reduces"] == 0, d


def test_ddp_automatic_mode_finalize_inside_backward_refused(rank0: dict[str, Any]) -> None:
    outcome = rank0["ddp"]["auto_inside_backward"]
    assert_refused(outcome, "inside backward", "after backward returns", "cadence.DataParallel")


@ddp_lacks_finalize
def test_ddp_manual_mode_finished_by_torch_at_end_of_backward(rank0: dict[str, Any]) -> None:
    m = rank0["ddp"]["manual"]
    assert m["backward_all_reduces"] == 1, m
    assert m["grad_vs_reduced_after_backward"] < 1e-6, m  # already reduced
    assert m["should_finalize_0"] is False and m["should_finalize_1"] is False, m
    assert_returned(m["finalize"])
    assert m["pending"]["done"] is True, m
    assert m["all_reduces_at_wait"] == 0 and m["parity_after_wait"] < 1e-6, m


@ddp_finalizes
def test_ddp_manual_finalize_writes_grads_at_wait(rank0: dict[str, Any]) -> None:
    m = rank0["ddp"]["manual"]
    assert m["should_finalize_0"] is False and m["should_finalize_1"] is True, m
    # The all-reduce launched in backward; .grad keeps the local gradients until
    # the handle's wait runs torch's finalize, which issues nothing more.
    assert m["backward_all_reduces"] == 1, m
    assert m["grad_vs_reduced_after_backward"] > 1e-3, m
    assert_returned(m["finalize"])
    assert m["all_reduces_at_wait"] == 0, m
    assert m["parity_after_wait"] < 1e-6, m
    # torch's "nothing to finalize" does not escape.
    assert_returned(m["second_finalize"])


@ddp_finalizes
def test_ddp_async_finalize_pending_until_waited(rank0: dict[str, Any]) -> None:
    m = rank0["ddp"]["manual"]
    p = m["pending"]
    _pending_handle_holds_everything_back(p)
    assert m["done_after_wait"] is True, m


@ddp_finalizes
def test_ddp_manual_finalize_inside_backward_once_the_bucket_is_ready(
    rank0: dict[str, Any],
) -> None:
    m = rank0["ddp"]["manual"]
    assert_returned(m["inside_backward"])
    assert m["inside_backward_all_reduces"] == 1, m
    assert_returned(m["after_inside_backward"])  # nothing left for the caller


@ddp_finalizes
def test_ddp_manual_finalize_inside_backward_too_early_refused(rank0: dict[str, Any]) -> None:
    m = rank0["ddp"]["manual"]
    # torch's own check (the bucket is not ready yet), as a cadence error.
    assert_refused(m["too_early"], "inside backward", "torch refused it", "after backward returns")
    assert_returned(m["after_too_early"])


@ddp_lacks_finalize
def test_ddp_manual_finalize_inside_backward_refused_without_torch_finalization(
    rank0: dict[str, Any],
) -> None:
    m = rank0["ddp"]["manual"]
    for case in ("inside_backward", "too_early"):
        assert_refused(m[case], "inside backward", "after backward returns", "cadence.DataParallel")
    assert_returned(m["after_inside_backward"])
    assert_returned(m["after_too_early"])


@pytest.mark.parametrize("mode", ["manual", "auto"])
def test_ddp_deferred_reduction_refused_with_the_fix(rank0: dict[str, Any], mode: str) -> None:
    d = rank0["ddp"]["deferred"][mode]
    # DDP reduces only from a backward's hooks, on every torch.
    assert_refused(d["finalize"], "accumulated with sync off", "before the last backward")
    assert_refused(d["step"], "never reduced", "run the last backward with sync on")
    assert d["all_reduces"] == 0, d


def test_split_backward_refused_for_torch_wrappers(rank0: dict[str, Any]) -> None:
    d = rank0["ddp"]
    assert_refused(d["split"], "every autograd call", "cadence.DataParallel")
    theirs, ours = d["split_refusal"]
    assert "torch wrapper" in theirs and "cadence.DataParallel" in theirs, theirs
    assert ours is None
