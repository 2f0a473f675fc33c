"""`DataParallel.overlap_optimizer`: each bucket stepped as its reduction completes. World 2.

- Parameters and optimizer state after N steps are bitwise those of the plain
  ``backward(); step(); zero_grad()`` loop with a StepLR schedule, for SGD (momentum,
  weight decay), Adam and AdamW, each foreach, single-tensor and fused.
- The same under accumulation (``no_sync()``, ``require_backward_grad_sync``), a bf16
  wire, ``gradient_as_bucket_view``, a checkpoint round trip, global-norm clipping
  (``max_grad_norm``), manual finalization (blocking, a handle, or left to
  ``opt.step()``), and an optimizer holding parameters outside the wrapper or not
  holding some of its own.
- Stepping is early: by event order on one clock, each bucket is stepped after its own
  all-reduce was waited, while the next one is issued and not yet waited, and before
  backward returns.
- Hooks and schedulers see one step per ``opt.step()``; refusals name cause and fix.

Only event order and values are asserted, never durations.
"""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.dp.bodies_overlap_optimizer import OPTIMIZERS, STEPS, overlap_optimizer_suite


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(overlap_optimizer_suite, world_size=2, timeout=240)


def _bitwise(r: dict[str, Any], buckets_stepped_early: bool = True) -> None:
    assert r["params"], "parameters differ from the plain loop"
    assert r["state"], "optimizer state differs from the plain loop"
    assert (r["early_steps"] > 0) is buckets_stepped_early


@pytest.mark.parametrize("label", list(OPTIMIZERS))
def test_params_and_state_are_bitwise_the_plain_loops(
    ranks: list[dict[str, Any]], label: str
) -> None:
    for r in ranks:
        _bitwise(r["parity"][label])


def test_no_sync_accumulation_steps_nothing_early_and_matches(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        _bitwise(r["accumulation"]["no_sync"])
        assert r["accumulation"]["stepped_in_no_sync"] == [0] * STEPS


def test_require_backward_grad_sync_accumulation_matches(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        _bitwise(r["accumulation"]["flag"])


def test_bf16_wire_and_bucket_views_match(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        _bitwise(r["mixed_precision"]["bf16_wire"])
        _bitwise(r["mixed_precision"]["bucket_view"])


def test_checkpoint_round_trip_saves_the_plain_state_and_resumes_bitwise(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        assert r["checkpoint"] == {"state_after_3": True, "resumed": True}


def test_max_grad_norm_clips_by_the_global_norm_and_steps_nothing_early(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        _bitwise(r["clipping"]["global_norm"], buckets_stepped_early=False)


def test_a_clip_after_buckets_stepped_raises_naming_max_grad_norm(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        assert r["clipping"]["user_clip"] == "ok"


def test_each_bucket_steps_while_the_next_is_in_flight_before_backward_returns(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        rows = r["early_order"]["rows"]
        assert [row["bucket"] for row in rows] == list(range(r["early_order"]["buckets"]))
        assert r["early_order"]["buckets"] >= 2
        for row in rows:
            assert row["after_own_wait"], row
            assert row["later_issued_not_waited"], row
            assert row["before_backward_returned"], row


def test_manual_finalization_steps_where_it_waits(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        m = r["manual"]
        for case in ("blocking", "handle", "opt_step_finalizes"):
            _bitwise(m[case])
        n = r["early_order"]["buckets"]
        # finalize_backward() and handle.wait() step every bucket; opt.step() adds none.
        assert m["marks_at"]["finalize"][:STEPS] == [n] * STEPS
        assert m["marks_at"]["wait"][:STEPS] == [n] * STEPS
        # A manual window left pending is finalized (and stepped) by opt.step().
        assert m["marks_at"]["step"][:STEPS] == [n * k for k in range(STEPS)]


@pytest.mark.parametrize("when", ["before", "after"])
def test_hooks_and_scheduler_see_one_step_per_opt_step(
    ranks: list[dict[str, Any]], when: str
) -> None:
    for r in ranks:
        h = r["hooks"][when]
        # The pre-hook runs before the first bucket steps (inside backward), post at step.
        assert h["calls"] == ["pre", "backward_returned", "post"] * 3 + [
            "pre",
            "post",
            "empty_step_returned",
        ]
        assert h["warnings"] == []
        assert h["lrs"] == pytest.approx([0.005, 0.01 * 2 / 3, 0.01 * 5 / 6])
        assert h["empty_step_unchanged"]


def test_params_outside_the_wrapper_are_stepped_at_opt_step(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["ownership"]["extra_param"]["params"]


def test_owned_params_missing_from_the_optimizer_are_not_stepped(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        case = r["ownership"]["first_layer_left_out"]
        assert case["params"] and case["left_out_unchanged"]


@pytest.mark.parametrize("name", ["lbfgs", "adagrad", "rmsprop", "subclass", "differentiable"])
def test_optimizers_not_proven_per_parameter_are_refused(
    ranks: list[dict[str, Any]], name: str
) -> None:
    assert ranks[0]["refusals"][name] == "ok"


@pytest.mark.parametrize("name", ["closure", "lr_mid_step", "second_forward"])
def test_what_an_overlapped_step_cannot_honour_raises(
    ranks: list[dict[str, Any]], name: str
) -> None:
    for r in ranks:
        assert r["refusals"][name] == "ok"
        assert r["refusals"]["recovers"]
