"""``overlap_optimizer`` on fully_shard modules: each unit stepped as its reduction completes.

Specification, at world 2 (gloo, one thread per rank) unless named; one case at
world 4 (HSDP 2 x 2):
- Parameters (gathered with ``full_tensor()``) and optimizer state after N steps are
  bitwise those of the plain ``backward(); step(); zero_grad()`` loop on the same
  fully_shard model with a StepLR schedule, for SGD (momentum, weight decay), Adam and
  AdamW, each foreach and single-tensor.
- The same under accumulation (``set_requires_gradient_sync(False)``, reductions left
  in flight with ``set_is_last_backward(False)``), mixed precision (bf16 parameters,
  a bf16 wire), ``reshard_after_backward=False`` with backward prefetch and more
  reductions in flight, synchronous reductions, a checkpoint round trip through
  ``torch.save``, global-norm clipping (``max_grad_norm``), manual finalization
  (blocking, a handle, or left to ``opt.step()``) and HSDP.
- Stepping is early: by event order on one clock, each unit is stepped after its own
  reduce-scatter (and HSDP all-reduce) was waited, while the next unit's reduce-scatter
  is issued and not yet waited, and before backward returns.
- Hooks and schedulers see one step per ``opt.step()``.
- Each refusal is a cadence error naming its cause and, where there is one, the fix
  (`REFUSED`): an optimizer that needs more than each parameter's own gradient, the
  overlap on a nested unit, a user clip after units stepped (``max_grad_norm=`` is the
  way), and what an overlapped step cannot honour (a closure, an ``lr`` changed
  mid-step, a second forward before ``opt.step()``); training goes on after the last.

Only event order and values are asserted, never durations.
"""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests._outcome import assert_refused
from tests.fsdp.bodies_overlap_optimizer import (
    OPTIMIZERS,
    STEPS,
    hsdp_suite,
    overlap_optimizer_suite,
)

# What each refusal's message must name.
REFUSED = {
    # Every refused class's message says why, naming LBFGS as the typical case.
    "lbfgs": ["cannot step", "LBFGS", "Fix:"],
    "adagrad": ["cannot step", "LBFGS", "Fix:"],
    "nested": ["call it on the root"],
    "user_clip": ["max_grad_norm=", "were changed after"],
    "closure": ["closure"],
    "lr_mid_step": ["'lr' changed", "Fix:"],
    "second_forward": ["set_requires_gradient_sync(False)", "opt.step()"],
}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(overlap_optimizer_suite, world_size=2, timeout=240)


@pytest.fixture(scope="module")
def hsdp() -> list[dict[str, Any]]:
    return run_distributed(hsdp_suite, world_size=4, timeout=150)


def _bitwise(r: dict[str, Any], units_stepped_early: bool = True) -> None:
    assert r["params"], "parameters differ from the plain loop"
    assert r["state"], "optimizer state differs from the plain loop"
    assert (r["early_steps"] > 0) is units_stepped_early


@pytest.mark.parametrize("label", list(OPTIMIZERS))
def test_params_and_state_are_bitwise_the_plain_loops(
    ranks: list[dict[str, Any]], label: str
) -> None:
    for r in ranks:
        case = r["parity"][label]
        _bitwise(case)
        assert case["early_steps"] == case["units"] * STEPS  # every unit, every step


def test_no_sync_accumulation_steps_nothing_early_and_matches(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        _bitwise(r["accumulation"]["no_sync"])
        assert r["accumulation"]["stepped_in_no_sync"] == [0] * STEPS


def test_reductions_left_in_flight_are_stepped_after_the_last_backward(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        case = r["accumulation"]["in_flight"]
        _bitwise(case)
        assert case["early_steps"] == case["units"] * STEPS  # once per unit, not per backward


def test_mixed_precision_bf16_params_and_bf16_wire_match(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        _bitwise(r["mixed_precision"]["bf16_params"])
        _bitwise(r["mixed_precision"]["bf16_wire"])


def test_no_reshard_after_backward_with_prefetch_and_more_in_flight_matches(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        _bitwise(r["settings"]["combined"])


def test_synchronous_reductions_match(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        _bitwise(r["settings"]["synchronous"])


def test_checkpoint_round_trip_saves_the_plain_state_and_resumes_bitwise(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        assert r["checkpoint"] == {"state_after_3": True, "resumed": True}


def test_max_grad_norm_clips_by_the_global_norm_and_steps_nothing_early(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        _bitwise(r["clipping"]["global_norm"], units_stepped_early=False)


def test_a_clip_after_units_stepped_raises_naming_max_grad_norm(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        assert_refused(r["clipping"]["user_clip"], *REFUSED["user_clip"])


def _assert_early(order: dict[str, Any]) -> None:
    rows = order["rows"]
    assert len(rows) == order["units"] >= 2
    assert sorted(row["unit"] for row in rows) == list(range(order["units"]))
    for row in rows:
        assert row["after_own_wait"], row
        assert row["after_own_all_reduce"], row
        assert row["later_issued_not_waited"], row
        assert row["before_backward_returned"], row


def test_each_unit_steps_while_the_next_is_in_flight_before_backward_returns(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        _assert_early(r["early_order"])


def test_manual_finalization_steps_where_it_waits(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        m = r["manual"]
        for case in ("blocking", "handle", "opt_step_finalizes"):
            _bitwise(m[case])
        n = r["early_order"]["units"]
        # finalize_backward() and handle.wait() step every unit; opt.step() adds none.
        assert m["marks_at"]["finalize"][:STEPS] == [n] * STEPS
        assert m["marks_at"]["wait"][:STEPS] == [n] * STEPS
        # Reductions left pending by a manual backward are finalized by opt.step().
        assert m["marks_at"]["step"][:STEPS] == [n * k for k in range(STEPS)]


def test_hooks_and_scheduler_see_one_step_per_opt_step(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        h = r["hooks"]
        # The pre-hook runs before the first unit steps (inside backward), post at step.
        assert h["calls"] == ["pre", "backward_returned", "post"] * 3
        assert h["warnings"] == []
        assert h["lrs"] == pytest.approx([0.005, 0.01 * 2 / 3, 0.01 * 5 / 6])


@pytest.mark.parametrize("name", ["lbfgs", "adagrad"])
def test_optimizers_needing_more_than_their_own_gradient_are_refused(
    ranks: list[dict[str, Any]], name: str
) -> None:
    assert_refused(ranks[0]["refusals"][name], *REFUSED[name])


def test_overlap_optimizer_on_a_nested_unit_is_refused(ranks: list[dict[str, Any]]) -> None:
    assert_refused(ranks[0]["refusals"]["nested"], *REFUSED["nested"])


@pytest.mark.parametrize("name", ["closure", "lr_mid_step", "second_forward"])
def test_what_an_overlapped_step_cannot_honour_raises(
    ranks: list[dict[str, Any]], name: str
) -> None:
    for r in ranks:
        assert_refused(r["refusals"][name], *REFUSED[name])
        assert r["refusals"]["recovers"]


def test_hsdp_2x2_is_bitwise_the_plain_loops(hsdp: list[dict[str, Any]]) -> None:
    for r in hsdp:
        _bitwise(r["parity"])


def test_hsdp_steps_each_unit_after_its_all_reduce(hsdp: list[dict[str, Any]]) -> None:
    for r in hsdp:
        _assert_early(r["early_order"])
