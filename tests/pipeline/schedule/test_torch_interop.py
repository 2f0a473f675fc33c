"""torch pipelining's schedules in cadence's IR: CSV files and lowered action lists.

The schedule layer itself never imports torch; these tests use torch only to
produce its files and lists, and to parse cadence's exports with torch's parser.
torch 2.15 lowers each stage's gradient reduction as REDUCE_GRAD + WAIT_REDUCE_GRAD
(and adds WAIT_SEND_F/B); torch 2.13 has neither wait, and its REDUCE_GRAD blocks.
The tests that need the wait are skipped, with that reason, where torch lacks it.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from unittest import mock

import pytest

from cadence.pipeline.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleValidationError,
    add_wait_reduce,
    complete_comms,
    generate,
    lower,
    parse_action,
    placement_for,
    torch_schedule_name,
    verify,
)

torch = pytest.importorskip("torch")
torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

# Feature-detected, not read off the version string: the action is what matters.
TORCH_HAS_REDUCE_WAIT = "WAIT_REDUCE_GRAD" in torch_schedules._ComputationType.__members__
needs_torch_reduce_wait = pytest.mark.skipif(
    not TORCH_HAS_REDUCE_WAIT,
    reason=f"torch {torch.__version__} has no WAIT_REDUCE_GRAD action (torch 2.15 "
    "added it); its REDUCE_GRAD blocks, so there is no torch wait to import",
)


def test_load_torch_produced_compute_csv(tmp_path) -> None:
    # The exact _dump_csv format: one row per rank, action strings, None -> empty cell.
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    order = get_schedule_ops("InterleavedZeroBubble", 2, 4, 2, add_spacing=True)
    path = tmp_path / "zb1p_2rank_2stagep_compute.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for row in order:
            writer.writerow(row)
    if any(a is None for row in order for a in row):
        assert ",," in path.read_text() or ",\n" in path.read_text()  # idle = empty cell
    s = Schedule.from_csv(path)
    assert s.placement == (0, 1, 0, 1) and s.meta.m == 4
    result = verify(lower(s))
    assert result.makespan > 0
    # Export back: every cell parses with torch's _Action.from_str.
    from torch.distributed.pipelining.schedules import _Action

    for row in csv.reader(s.to_csv().splitlines()):
        for cell in row:
            assert str(_Action.from_str(cell)) == cell


def _torch_rows(
    name: str, p: int, m: int, v: int, *, defer_reduce_grad_wait: bool = False
) -> list[list[str]]:
    """torch's own lowered per-rank lists, as its action strings.

    The default is ``get_schedule_ops(..., with_comms=True)`` (what
    ``build_pipeline(source="torch")`` imports). ``defer_reduce_grad_wait`` is a
    schedule constructor option the visualiser does not pass, so that case builds
    the schedule the way the visualiser does (mock stages, no process group) and
    reads the list the schedule lowered for itself.
    """
    if not defer_reduce_grad_wait:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

        ops = get_schedule_ops(torch_schedule_name(name), p, m, v, with_comms=True)
        return [[str(a) for a in row if a is not None] for row in ops]
    from torch.distributed.pipelining import PipelineStage as TorchStage

    stage = mock.create_autospec(TorchStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, p, None
    stage.num_stages = p * v
    cls = torch_schedules.get_schedule_class(torch_schedule_name(name))
    sched = cls([stage] * v, m, defer_reduce_grad_wait=True)
    return [[str(a) for a in sched.pipeline_order_with_comms[r]] for r in range(p)]


def _torch_lowered(name: str, p: int, m: int, v: int) -> Schedule:
    rows = _torch_rows(name, p, m, v)
    return Schedule.from_lists(rows, placement_for(name, p, v), lowered=True)


# torch's lowered makespans at equal durations, replayed by cadence's simulator.
TORCH_MAKESPANS = {
    "interleaved": 28.5,
    "looped_bfs": 28.5,
    "zb_h1": 25.5,
    "zbv": 25.5,
    "dualpipev": 27.0,
}


@pytest.mark.parametrize("name", sorted(TORCH_MAKESPANS))
def test_torch_lowered_lists_complete_and_verify(name: str) -> None:
    sched = _torch_lowered(name, 4, 8, 2)
    low = complete_comms(sched)
    # torch leaves same-rank hand-offs implicit: complete_comms adds a LOCAL for each.
    n_local = sum(a.kind is ActionKind.LOCAL for r in low.ranks for a in r)
    n_same_rank = sum(
        1 for s in range(low.num_stages - 1) if low.placement[s] == low.placement[s + 1]
    )
    assert n_local == 2 * 8 * n_same_rank  # both directions, every microbatch
    for acts in low.ranks:
        for a in acts:
            if a.kind in (ActionKind.SEND, ActionKind.RECV):
                assert a.channel is not None and a.seq is not None
    assert verify(low).makespan == TORCH_MAKESPANS[name]
    # cadence's own generator reaches the same makespan.
    assert verify(lower(generate(name, 4, 8, 2))).makespan == TORCH_MAKESPANS[name]


def _back_to_torch(low: Schedule, rank: int) -> list[str]:
    """Rank ``rank`` of an imported schedule without what `complete_comms` added,
    as torch's action strings: LOCAL hand-offs dropped, channels and sequence
    numbers cleared and, where torch has no wait action, the WAIT_REDUCE_GRAD that
    completion gives each blocking REDUCE_GRAD dropped (after checking that it
    sits right after its REDUCE_GRAD)."""
    acts = low.ranks[rank]
    out: list[str] = []
    for i, a in enumerate(acts):
        if a.kind is ActionKind.LOCAL:
            continue
        if a.kind is ActionKind.WAIT_REDUCE_GRAD and not TORCH_HAS_REDUCE_WAIT:
            assert acts[i - 1] == Action(ActionKind.REDUCE_GRAD, a.stage), (rank, i, a)
            continue
        out.append(str(replace(a, channel=None, seq=None)))
    return out


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2)])
@pytest.mark.parametrize("name", sorted(TORCH_MAKESPANS))
def test_torch_lowered_lists_import_action_for_action(name: str, p: int, m: int, v: int) -> None:
    # Every action of torch's lists (SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD, and on
    # torch 2.15 WAIT_REDUCE_GRAD and WAIT_SEND_F/B) is imported, in torch's order,
    # and the import adds nothing else than LOCALs, channels, numbers (and, on torch
    # without a wait action, the wait of each blocking REDUCE_GRAD).
    rows = _torch_rows(name, p, m, v)
    low = complete_comms(Schedule.from_lists(rows, placement_for(name, p, v), lowered=True))
    for r in range(p):
        assert _back_to_torch(low, r) == rows[r], f"rank {r}"
    kinds = {a.kind for acts in low.ranks for a in acts}
    assert {
        ActionKind.SEND,
        ActionKind.RECV,
        ActionKind.UNSHARD,
        ActionKind.RESHARD,
        ActionKind.REDUCE_GRAD,
        ActionKind.WAIT_REDUCE_GRAD,
    } <= kinds
    if TORCH_HAS_REDUCE_WAIT:
        assert ActionKind.WAIT_SEND in kinds
    n_waits = sum(row.count(f"{s}WAIT_REDUCE_GRAD") for row in rows for s in range(p * v))
    assert n_waits == (p * v if TORCH_HAS_REDUCE_WAIT else 0)
    verify(low)


@needs_torch_reduce_wait
@pytest.mark.parametrize("deferred", [False, True], ids=["after_issue", "deferred"])
@pytest.mark.parametrize("name", sorted(TORCH_MAKESPANS))
def test_torch_wait_reduce_grad_is_imported_where_torch_puts_it(name: str, deferred: bool) -> None:
    # Both notations read the text alike: stage 4, a wait, no microbatch.
    ta = torch_schedules._Action.from_str("4WAIT_REDUCE_GRAD")
    assert (ta.stage_index, ta.computation_type.value, ta.microbatch_index) == (
        4,
        "WAIT_REDUCE_GRAD",
        None,
    )
    assert parse_action("4WAIT_REDUCE_GRAD") == Action(ActionKind.WAIT_REDUCE_GRAD, 4)
    p, m, v = 4, 8, 2
    rows = _torch_rows(name, p, m, v, defer_reduce_grad_wait=deferred)
    low = complete_comms(Schedule.from_lists(rows, placement_for(name, p, v), lowered=True))
    for r, acts in enumerate(low.ranks):
        assert _back_to_torch(low, r) == rows[r], f"rank {r}"
        issues = [i for i, a in enumerate(acts) if a.kind is ActionKind.REDUCE_GRAD]
        waits = [i for i, a in enumerate(acts) if a.kind is ActionKind.WAIT_REDUCE_GRAD]
        assert len(issues) == len(waits) == v, (r, issues, waits)
        for n, (i, j) in enumerate(zip(issues, waits, strict=True)):
            # Each wait is for the reduction issued last: one in flight per rank.
            assert acts[j].stage == acts[i].stage and i < j, (r, acts[i], acts[j])
            between = acts[i + 1 : j]
            assert not any(a.kind is ActionKind.REDUCE_GRAD for a in between), (r, acts[j])
            later = acts[j + 1 :]
            if not deferred:
                # torch's default: the wait follows its issue, no compute between.
                assert not any(a.is_compute for a in between), (r, acts[j])
            elif n + 1 < len(issues):
                # Deferred: waited just before the next use of the one in-flight
                # slot, the rank's next REDUCE_GRAD; the compute of the other local
                # stage runs while the first reduction is in flight.
                assert later[0].kind is ActionKind.REDUCE_GRAD, (r, acts[j], later[0])
                assert any(a.is_compute for a in between), (r, acts[j])
            else:
                # The last one: at the end of the step, before the optimizer.
                assert not any(a.is_compute or a.kind is ActionKind.REDUCE_GRAD for a in later)
    result = verify(low)
    assert result.peak_reductions == (1,) * p
    if deferred:
        # Where torch defers a wait is where cadence's own pass (K = 1) puts it:
        # same order of computes, issues and waits once torch's waits are removed
        # and cadence's placed instead.
        stripped = low.with_ranks(
            [[a for a in acts if a.kind is not ActionKind.WAIT_REDUCE_GRAD] for acts in low.ranks]
        )
        ours = add_wait_reduce(stripped, max_outstanding=1)

        def skeleton(acts: tuple[Action, ...]) -> list[str]:
            keep = (ActionKind.REDUCE_GRAD, ActionKind.WAIT_REDUCE_GRAD)
            return [str(a) for a in acts if a.is_compute or a.kind in keep]

        for r in range(p):
            assert skeleton(ours.ranks[r]) == skeleton(low.ranks[r]), f"rank {r}"


# torch 2.15's lowered format, written out (GPipe, 2 ranks, 2 microbatches): its own
# reduction waits and send waits. The same list without the reduction waits is
# torch 2.13's format. These need no particular torch, so they run everywhere.
_TORCH_215_GPIPE = [
    [
        "0F0",
        "0SEND_F0",
        "0F1",
        "0SEND_F1",
        "0RECV_B0",
        "0B0",
        "0WAIT_SEND_F0",
        "0RECV_B1",
        "0B1",
        "0WAIT_SEND_F1",
        "0REDUCE_GRAD",
        "0WAIT_REDUCE_GRAD",
    ],
    [
        "1RECV_F0",
        "1F0",
        "1RECV_F1",
        "1F1",
        "1B0",
        "1SEND_B0",
        "1B1",
        "1SEND_B1",
        "1REDUCE_GRAD",
        "1WAIT_REDUCE_GRAD",
        "1WAIT_SEND_B0",
        "1WAIT_SEND_B1",
    ],
]


def test_complete_comms_keeps_torch_reduction_waits() -> None:
    low = complete_comms(Schedule.from_lists(_TORCH_215_GPIPE, lowered=True))
    assert [[str(replace(a, channel=None, seq=None)) for a in acts] for acts in low.ranks] == (
        _TORCH_215_GPIPE
    )
    assert low.ranks[0][-1] == Action(ActionKind.WAIT_REDUCE_GRAD, 0)
    assert low.ranks[1][9] == Action(ActionKind.WAIT_REDUCE_GRAD, 1)
    verify(low)
    # torch 2.13's form: no wait in the list, so each blocking REDUCE_GRAD gets one.
    blocking = [[a for a in row if "WAIT_REDUCE_GRAD" not in a] for row in _TORCH_215_GPIPE]
    low = complete_comms(Schedule.from_lists(blocking, lowered=True))
    for acts in low.ranks:
        i = next(i for i, a in enumerate(acts) if a.kind is ActionKind.REDUCE_GRAD)
        assert acts[i + 1] == Action(ActionKind.WAIT_REDUCE_GRAD, acts[i].stage)
        assert sum(a.kind is ActionKind.WAIT_REDUCE_GRAD for a in acts) == 1
    verify(low)


def test_torch_list_with_some_reduction_waits_must_have_all() -> None:
    # A list with waits carries all of them; completion does not guess the rest.
    rows = [list(row) for row in _TORCH_215_GPIPE]
    rows[1].remove("1WAIT_REDUCE_GRAD")
    low = complete_comms(Schedule.from_lists(rows, lowered=True))
    with pytest.raises(ScheduleValidationError, match="missing WAIT_REDUCE_GRAD for stage 1"):
        verify(low)


def test_complete_comms_refuses_cadence_lowered() -> None:
    with pytest.raises(ScheduleValidationError, match="already has cadence's fields"):
        complete_comms(lower(generate("zbv", 2, 4)))
    # ... and a torch list completed once (LOCALs aside, its numbers give it away).
    once = complete_comms(Schedule.from_lists(_TORCH_215_GPIPE, lowered=True))
    with pytest.raises(ScheduleValidationError, match="already has cadence's fields"):
        complete_comms(once)


def test_torch_fifo_swap_is_refused_after_completion() -> None:
    # Rank 1 posts its receives out of send order: completion numbers them from
    # the sends, and the simulator names the swap instead of running it.
    sched = Schedule.from_lists(
        [
            ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B1", "0RECV_B0", "0B0", "0B1"],
            ["1RECV_F1", "1RECV_F0", "1F0", "1F1", "1B0", "1SEND_B0", "1B1", "1SEND_B1"],
        ],
        lowered=True,
    )
    with pytest.raises(ScheduleValidationError, match="FIFO mismatch on channel"):
        verify(complete_comms(sched))
