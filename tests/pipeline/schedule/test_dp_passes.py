"""Deferred reductions (<= K in flight) and UNSHARD/RESHARD placement, in the IR and
in the simulator (which checks residency and reports memory)."""

from __future__ import annotations

import pytest

from cadence.pipeline.schedule import (
    ActionKind,
    MemoryModel,
    Schedule,
    ScheduleValidationError,
    add_unshard_reshard,
    add_wait_reduce,
    generate,
    lower,
    simulate,
    validate_lowered,
    verify,
)

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free


def _kinds(acts, *kinds) -> list[str]:
    return [str(a) for a in acts if a.kind in kinds]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_reductions_in_flight_at_most_k(k: int) -> None:
    low = lower(generate("interleaved", 2, 4, 3), max_outstanding_reductions=k)
    result = verify(low)
    # Three local stages per rank: min(k, 3) reductions overlap at the peak.
    assert result.peak_reductions == (min(k, 3), min(k, 3))
    rank0 = _kinds(low.ranks[0], ActionKind.REDUCE_GRAD, ActionKind.WAIT_REDUCE_GRAD)
    if k == 1:
        assert rank0 == [
            "4REDUCE_GRAD",
            "4WAIT_REDUCE_GRAD",
            "2REDUCE_GRAD",
            "2WAIT_REDUCE_GRAD",
            "0REDUCE_GRAD",
            "0WAIT_REDUCE_GRAD",
        ]
    if k >= 3:  # every wait deferred to the end of the step
        assert rank0[3:] == ["4WAIT_REDUCE_GRAD", "2WAIT_REDUCE_GRAD", "0WAIT_REDUCE_GRAD"]


def test_each_reduction_is_issued_before_the_other_stages_finish() -> None:
    # The reduction of the first finished stage overlaps the other stage's backward.
    low = lower(generate("zbv", 2, 4))
    acts = list(low.ranks[0])
    first = next(i for i, a in enumerate(acts) if a.kind is ActionKind.REDUCE_GRAD)
    other = {3, 0} - {acts[first].stage}
    assert any(c.stage in other for a in acts[first:] for c in a.compute_parts())


def test_max_outstanding_must_be_positive() -> None:
    low = lower(generate("1f1b", 2, 2), reduce_grad=False)
    with pytest.raises(ScheduleValidationError, match="max_outstanding must be an int >= 1"):
        add_wait_reduce(low, max_outstanding=0)


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zbv", "dualpipev"])
@pytest.mark.parametrize("lookahead", [0, 1, 3])
def test_one_unshard_and_reshard_per_stage(name: str, lookahead: int) -> None:
    sched = generate(name, 2, 4)
    low = lower(sched, unshard_lookahead=lookahead)
    result = verify(low, mode="shared")
    for r, acts in enumerate(low.ranks):
        acts = list(acts)
        for s in low.stages_of(r):
            # One all-gather per stage per step ...
            (u,) = [i for i, a in enumerate(acts) if a.kind is ActionKind.UNSHARD and a.stage == s]
            (f,) = [i for i, a in enumerate(acts) if a.kind is ActionKind.RESHARD and a.stage == s]
            uses = [i for i, a in enumerate(acts) for c in a.compute_parts() if c.stage == s]
            # ... `lookahead` computes ahead of the first use (or at the start) ...
            computes = [i for i, a in enumerate(acts) if a.is_compute]
            between = sum(1 for i in computes if u < i < uses[0])
            assert between == min(lookahead, computes.index(uses[0]))
            # ... and the free after the last use and after the stage's reduction.
            assert f > uses[-1]
            red = [
                i for i, a in enumerate(acts) if a.kind is ActionKind.REDUCE_GRAD and a.stage == s
            ]
            assert f > red[0]
            assert not any(a.is_compute for a in acts[uses[-1] + 1 : f])
    assert result.peak_memory


def test_memory_counts_parameters_and_activations() -> None:
    mem = MemoryModel(activation=1.0, parameters=100.0)
    sched = generate("interleaved", 2, 4, 2)
    plain = simulate(lower(sched), memory=mem)
    # Without UNSHARD actions both local stages count as resident all step.
    assert plain.peak_memory == tuple(200 + pk for pk in plain.peak_inflight)
    gathered = simulate(lower(sched, unshard_lookahead=0), memory=mem)
    assert gathered.peak_memory == plain.peak_memory  # both are gathered at the peak
    assert "peak memory" in plain.summary()
    # Parameters only: the most stages resident at once.
    params = MemoryModel(activation=0.0, parameters=1.0)
    assert simulate(
        lower(generate("1f1b", 2, 4), unshard_lookahead=0), memory=params
    ).peak_memory == (1, 1)


def test_unshard_arguments_and_twice() -> None:
    low = lower(generate("1f1b", 2, 2), unshard_lookahead=1)
    with pytest.raises(ScheduleValidationError, match="already has UNSHARD/RESHARD"):
        add_unshard_reshard(low)
    with pytest.raises(ScheduleValidationError, match="lookahead must be an int >= 0"):
        lower(generate("1f1b", 2, 2), unshard_lookahead=-1)


# -- residency validation: one rule, one failing schedule each --------------------


def _rows() -> list[list[str]]:
    low = lower(generate("1f1b", 2, 2), unshard_lookahead=0)
    return [[str(a) for a in acts] for acts in low.ranks]


def _check(rows: list[list[str]], match: str) -> None:
    with pytest.raises(ScheduleValidationError, match=match):
        validate_lowered(Schedule.from_lists(rows, placement=[0, 1]))


def test_residency_rows_are_valid() -> None:
    rows = _rows()
    assert rows[0][0] == "0UNSHARD"
    assert rows[0][-3:] == ["0REDUCE_GRAD", "0RESHARD", "0WAIT_REDUCE_GRAD"]
    validate_lowered(Schedule.from_lists(rows, placement=[0, 1]))


def test_compute_before_unshard() -> None:
    rows = _rows()
    rows[0].remove("0UNSHARD")
    rows[0].insert(1, "0UNSHARD")
    _check(rows, "stage 0 computes before its UNSHARD")


def test_compute_after_reshard() -> None:
    rows = _rows()
    rows[1].remove("1RESHARD")
    rows[1].insert(rows[1].index("1B1"), "1RESHARD")
    _check(rows, "stage 1 computes after its RESHARD")


def test_duplicate_unshard() -> None:
    rows = _rows()
    rows[0].insert(0, "0UNSHARD")
    _check(rows, "duplicate UNSHARD for stage 0")


def test_reshard_before_unshard() -> None:
    rows = _rows()
    rows[1].insert(0, "1RESHARD")
    _check(rows, "RESHARD of stage 1 before its UNSHARD")


def test_missing_reshard() -> None:
    rows = _rows()
    rows[1].remove("1RESHARD")
    _check(rows, "missing RESHARD for stage 1")


def test_unshard_on_another_rank() -> None:
    rows = _rows()
    rows[0].insert(0, "1UNSHARD")
    _check(rows, "stage 1 lives on rank 1; its parameters are gathered and freed there")


def test_simulator_refuses_compute_on_a_resharded_stage() -> None:
    rows = _rows()
    rows[0].remove("0RESHARD")
    rows[0].insert(rows[0].index("0B1"), "0RESHARD")
    sched = Schedule.from_lists(rows, placement=[0, 1], lowered=True)
    with pytest.raises(ScheduleValidationError, match="stage 0's parameters are not gathered"):
        simulate(sched)
