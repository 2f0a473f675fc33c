"""Every IR validation error has its own test and a specific message."""

from __future__ import annotations

import dataclasses

import pytest

from cadence.pipeline.schedule import (
    Schedule,
    ScheduleValidationError,
    generate,
    lower,
    one_f_one_b,
    validate_compute,
    validate_lowered,
)

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free


def _sched(rows, placement=None, m=None) -> Schedule:
    return Schedule.from_lists(rows, placement, m=m)


def test_b_before_f() -> None:
    with pytest.raises(
        ScheduleValidationError, match=r"without first running its forward \(B before F\)"
    ):
        validate_compute(_sched([["0B0", "0F0"], ["1F0", "1B0"]]))


def test_w_before_i() -> None:
    with pytest.raises(ScheduleValidationError, match=r"W before I"):
        validate_compute(_sched([["0F0", "0W0", "0I0"], ["1F0", "1I0", "1W0"]]))


def test_i_without_w() -> None:
    with pytest.raises(ScheduleValidationError, match="I without its W"):
        validate_compute(_sched([["0F0", "0I0"], ["1F0", "1B0"]]))


def test_stage_on_two_ranks_inferred() -> None:
    with pytest.raises(ScheduleValidationError, match="stage 0 appears on rank 0 and on rank 1"):
        _sched([["0F0", "0B0"], ["0F1", "1F0", "1B0"]])


def test_stage_on_wrong_rank_for_placement() -> None:
    with pytest.raises(ScheduleValidationError, match="placed on rank 0 but computes on rank 1"):
        validate_compute(_sched([["0F0", "0B0"], ["0F1", "1F0", "1B0"]], placement=[0, 1]))


def test_missing_microbatch() -> None:
    with pytest.raises(ScheduleValidationError, match="missing the forward of microbatch 1"):
        validate_compute(_sched([["0F0", "0B0"], ["1F0", "1F1", "1B0", "1B1"]], m=2))


def test_missing_backward() -> None:
    with pytest.raises(ScheduleValidationError, match="missing the backward of microbatch 1"):
        validate_compute(_sched([["0F0", "0F1", "0B0"], ["1F0", "1F1", "1B0", "1B1"]]))


def test_microbatch_out_of_range() -> None:
    with pytest.raises(ScheduleValidationError, match=r"microbatch 2 is out of range 0\.\.1"):
        validate_compute(_sched([["0F0", "0F2", "0B0"], ["1F0", "1B0"]], m=2))


def test_duplicate_action() -> None:
    with pytest.raises(ScheduleValidationError, match="runs twice"):
        validate_compute(_sched([["0F0", "0F0", "0B0"], ["1F0", "1B0"]]))


def test_torch_2_13_last_rank_1f1b_ir_is_rejected() -> None:
    # torch 2.13's Schedule1F1B._get_pipeline_order() on rank 3 of p=4, m=8: forward
    # indices shifted by one, microbatch 8 out of range (torch runs a hand-written
    # loop instead, so only its pictures show this IR).
    broken = ["3F1", "3B0"] + [x for k in range(2, 9) for x in (f"3F{k}", f"3B{k - 1}")]
    rows = [[str(a) for a in r] for r in one_f_one_b(4, 8).ranks]
    rows[3] = broken
    with pytest.raises(ScheduleValidationError, match=r"rank 3, action 1 \(3B0\).*B before F"):
        validate_compute(_sched(rows, m=8))
    # cadence's own 1F1B is valid on every rank, the last one starting F0, B0.
    validate_compute(one_f_one_b(4, 8))
    assert [str(a) for a in one_f_one_b(4, 8).ranks[3][:2]] == ["3F0", "3B0"]


# -- lowered rules --------------------------------------------------------------

_GOOD = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]


def test_good_lowered_passes() -> None:
    validate_lowered(_sched(_GOOD))


def test_recv_without_send() -> None:
    rows = [["0F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    with pytest.raises(ScheduleValidationError, match="RECV without a matching SEND"):
        validate_lowered(_sched(rows))


def test_send_without_recv() -> None:
    rows = [
        ["0F0", "0SEND_F0", "0RECV_B0", "0B0"],
        ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1SEND_B0.1"],
    ]
    with pytest.raises(ScheduleValidationError, match="SEND without a matching RECV"):
        validate_lowered(_sched(rows))


def test_unconsumed_recv() -> None:
    rows = [
        ["0F0", "0SEND_F0", "0SEND_F0.1", "0RECV_B0", "0B0"],
        ["1RECV_F0", "1RECV_F0.1", "1F0", "1B0", "1SEND_B0"],
    ]
    with pytest.raises(ScheduleValidationError, match="never consumed \\(unconsumed RECV\\)"):
        validate_lowered(_sched(rows))


def test_compute_without_its_recv() -> None:
    rows = [["0F0", "0SEND_F0", "0B0", "0RECV_B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    with pytest.raises(ScheduleValidationError, match="no earlier RECV or LOCAL on rank 0"):
        validate_lowered(_sched(rows))


def test_send_before_producer() -> None:
    rows = [["0SEND_F0", "0F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    with pytest.raises(ScheduleValidationError, match="SEND before its producer"):
        validate_lowered(_sched(rows))


def test_local_across_ranks() -> None:
    rows = [["0F0", "0LOCAL_F0~1", "0RECV_B0", "0B0"], ["1F0", "1B0", "1SEND_B0"]]
    with pytest.raises(ScheduleValidationError, match="LOCAL between stages on ranks 0 and 1"):
        validate_lowered(_sched(rows))


def test_send_within_a_rank() -> None:
    rows = [["0F0", "0SEND_F0", "1RECV_F0", "1F0", "1B0", "1LOCAL_B0~0", "0B0"], []]
    with pytest.raises(ScheduleValidationError, match="on the same rank; use LOCAL"):
        validate_lowered(_sched(rows, placement=[0, 0]))


def test_wait_reduce_before_reduce() -> None:
    rows = [r[:] for r in _GOOD]
    rows[0] = ["0WAIT_REDUCE_GRAD", *rows[0], "0REDUCE_GRAD"]
    with pytest.raises(
        ScheduleValidationError, match="WAIT_REDUCE_GRAD for stage 0 before its REDUCE_GRAD"
    ):
        validate_lowered(_sched(rows))


def test_lowering_twice_is_refused() -> None:
    with pytest.raises(ScheduleValidationError, match="already lowered"):
        lower(lower(generate("1f1b", 2, 2)))


def test_channel_field_must_match_the_placement() -> None:
    rows = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    sched = _sched(rows)
    bad = [list(r) for r in sched.ranks]
    bad[0][1] = dataclasses.replace(bad[0][1], channel=(1, 0))
    with pytest.raises(
        ScheduleValidationError, match=r"channel \(1, 0\) but stage 0 -> 1 is rank 0 -> 1"
    ):
        validate_lowered(sched.with_ranks(bad))


# -- gradient reductions: one rule, one failing schedule each ---------------------


def _reduced() -> list[list[str]]:
    """1F1B on 2 ranks, lowered with REDUCE_GRAD / WAIT_REDUCE_GRAD, as text rows."""
    return [[str(a) for a in acts] for acts in lower(generate("1f1b", 2, 2)).ranks]


def _check(rows: list[list[str]], match: str) -> None:
    with pytest.raises(ScheduleValidationError, match=match):
        validate_lowered(_sched(rows, placement=[0, 1]))


def test_lowered_reductions_are_valid() -> None:
    rows = _reduced()
    assert rows[0][-2:] == ["0REDUCE_GRAD", "0WAIT_REDUCE_GRAD"]
    validate_lowered(_sched(rows, placement=[0, 1]))


def test_duplicate_reduce_grad() -> None:
    rows = _reduced()
    rows[0].insert(rows[0].index("0REDUCE_GRAD"), "0REDUCE_GRAD")
    _check(rows, r"duplicate REDUCE_GRAD for stage 0 \(first at action")


def test_duplicate_wait_reduce_grad() -> None:
    rows = _reduced()
    rows[1].append("1WAIT_REDUCE_GRAD")
    _check(rows, "duplicate WAIT_REDUCE_GRAD for stage 1")


def test_missing_wait_reduce_grad() -> None:
    rows = _reduced()
    rows[1].remove("1WAIT_REDUCE_GRAD")
    _check(rows, "missing WAIT_REDUCE_GRAD for stage 1; a reduction issued in a step")


def test_missing_reduce_grad_for_one_stage() -> None:
    rows = _reduced()
    rows[1] = [a for a in rows[1] if "REDUCE" not in a]
    _check(rows, r"missing REDUCE_GRAD for stage\(s\) \[1\] .* reduce_grad=False")
    # None at all is an accumulation step: valid.
    validate_lowered(lower(generate("1f1b", 2, 2), reduce_grad=False))


def test_reduce_grad_before_last_backward() -> None:
    rows = _reduced()
    rows[0].remove("0REDUCE_GRAD")
    rows[0].insert(rows[0].index("0B1"), "0REDUCE_GRAD")
    _check(rows, "REDUCE_GRAD for stage 0 before its last backward")


def test_reduce_grad_on_another_rank() -> None:
    rows = _reduced()
    rows[0] += ["1REDUCE_GRAD", "1WAIT_REDUCE_GRAD"]
    _check(rows, "stage 1 lives on rank 1; a stage's reduction runs on its own rank")
