"""torch pipelining's schedules in cadence's IR: CSV files and lowered action lists.

The schedule layer itself never imports torch; these tests use torch only to
produce its files and lists, and to parse cadence's exports with torch's parser.
"""

from __future__ import annotations

import csv

import pytest

from cadence.pipeline.schedule import (
    ActionKind,
    Schedule,
    ScheduleValidationError,
    complete_comms,
    generate,
    lower,
    placement_for,
    torch_schedule_name,
    verify,
)

pytest.importorskip("torch")


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


def _torch_lowered(name: str, p: int, m: int, v: int) -> Schedule:
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(torch_schedule_name(name), p, m, v, with_comms=True)
    rows = {r: [str(a) for a in ops[r] if a is not None] for r in range(p)}
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


def test_complete_comms_refuses_cadence_lowered() -> None:
    with pytest.raises(ScheduleValidationError, match="already has cadence's fields"):
        complete_comms(lower(generate("zbv", 2, 4)))


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
