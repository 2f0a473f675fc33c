"""Building blocks shared by the schedule generators: placements, microbatch groups,
the depth-first chunk order, and a compute-only replay used to choose among orders.

[Note: microbatch groups]
Interleaved schedules walk microbatches depth first in groups: every local chunk
runs a group of microbatches before the next group starts, so microbatch k comes
back to rank 0 (after p hops) just as rank 0 finishes the group. A group therefore
needs at least p microbatches to keep rank 0 busy. Megatron and torch 2.13 use
equal groups and refuse an m they do not divide; cadence splits m into
``max(1, m // p)`` groups as evenly as possible (sizes differ by at most one, larger
first), which is the same split wherever the equal split exists and keeps every
group at >= p microbatches otherwise. ``m < p`` gives one group of m: rank 0 then
idles while the microbatches travel, which no order can avoid.
"""

from __future__ import annotations

from collections.abc import Sequence

from cadence.pipeline.schedule._errors import ScheduleValidationError
from cadence.pipeline.schedule.ir import Action, ActionKind, Schedule, ScheduleMeta
from cadence.pipeline.schedule.validate import Edge, inputs_of, outputs_of

__all__ = [
    "check_sizes",
    "compute_times",
    "depth_first",
    "loop_placement",
    "make_schedule",
    "microbatch_groups",
    "replay",
    "v_placement",
]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741


def loop_placement(p: int, v: int) -> tuple[int, ...]:
    """Stage s on rank s % p (interleaved, LoopedBFS, ZB-H1)."""
    return tuple(s % p for s in range(p * v))


def v_placement(p: int) -> tuple[int, ...]:
    """Two chunks per rank in a V: 0..p-1 then p-1..0 (ZBV, DualPipeV)."""
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


def check_sizes(p: int, m: int, v: int = 1) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ScheduleValidationError(f"need p >= 1, m >= 1, v >= 1; got p={p}, m={m}, v={v}")


def make_schedule(
    name: str, rows: Sequence[Sequence[Action]], placement: tuple[int, ...], v: int, m: int
) -> Schedule:
    meta = ScheduleMeta(generator=name, p=len(rows), v=v, m=m, lowered=False)
    return Schedule(placement, tuple(tuple(r) for r in rows), meta)


def microbatch_groups(m: int, p: int) -> list[int]:
    """Group sizes for the depth-first order; see [Note: microbatch groups]."""
    rounds = max(1, m // p)
    base, extra = divmod(m, rounds)
    return [base + 1] * extra + [base] * (rounds - extra)


def depth_first(
    p: int, m: int, v: int, r: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Rank r's (stage, microbatch) sequence of forwards and of backwards.

    Forwards go chunk 0..v-1 within each group, backwards chunk v-1..0: the order
    in which the chunks of one group become ready on this rank.
    """
    fwd: list[tuple[int, int]] = []
    bwd: list[tuple[int, int]] = []
    start = 0
    for size in microbatch_groups(m, p):
        mbs = range(start, start + size)
        fwd += [(c * p + r, k) for c in range(v) for k in mbs]
        bwd += [(c * p + r, k) for c in reversed(range(v)) for k in mbs]
        start += size
    return fwd, bwd


def compute_times(
    sched: Schedule, cost: dict[ActionKind, float]
) -> list[list[tuple[float, float]]]:
    """(start, end) of every compute action, per rank in program order.

    Each compute starts when its rank is free and its cross-stage inputs exist;
    transfers take no time and non-compute actions are skipped, so this works on
    compute-only and lowered schedules alike. ``cost`` gives F, I, W and B; an
    FB_OVERLAP costs the sum of its parts. Raises `ScheduleValidationError` if
    some input is never produced (the compute order itself deadlocks).
    """
    n = sched.num_stages
    rows = [[a for a in acts if a.is_compute] for acts in sched.ranks]
    times: list[list[tuple[float, float]]] = [[] for _ in rows]
    produced: dict[Edge, float] = {}
    free = [0.0] * len(rows)
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(rows):
            while len(times[r]) < len(acts):
                a = acts[len(times[r])]
                need = [produced.get(e) for e in inputs_of(a, n)]
                ready = [t for t in need if t is not None]
                if len(ready) < len(need):
                    break
                start = max([free[r], *ready])
                free[r] = start + sum(cost[c.kind] for c in a.compute_parts())
                times[r].append((start, free[r]))
                for e in outputs_of(a, n):
                    produced[e] = free[r]
                progress = True
    for r, acts in enumerate(rows):
        if len(times[r]) < len(acts):
            raise ScheduleValidationError(
                f"the compute order deadlocks: rank {r}'s action {acts[len(times[r])]} waits "
                "for an input that no rank ever produces before it is needed"
            )
    return times


def replay(sched: Schedule, *, f: float = 1.0, i: float = 1.0, w: float = 1.0) -> tuple[float, int]:
    """(makespan, peak in-flight chunk activations on any rank) of a compute-only order.

    Durations are per full stage, divided by the chunks per rank, as in the
    simulator's default `TimeModel`, so on a schedule whose lowering is
    deadlock-free this is the simulator's makespan (the generators use it to pick
    among candidate orders without lowering them).
    """
    v = max(1, sched.num_stages // sched.num_ranks)
    times = compute_times(sched, {F: f / v, I: i / v, W: w / v, B: (i + w) / v})
    peak = 0
    for acts in sched.ranks:
        live = 0
        for a in acts:
            for c in a.compute_parts():
                live += 1 if c.kind is F else -1 if c.kind in (B, W) else 0
            peak = max(peak, live)
    return max((t[-1][1] for t in times if t), default=0.0), peak
