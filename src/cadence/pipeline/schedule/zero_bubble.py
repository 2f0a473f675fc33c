"""Zero-bubble generators: ZB-H1 (and its interleaved form), ZBV and DualPipeV.

All three split the backward into I (input gradient, on the critical path: the
previous stage waits for it) and W (weight gradient, needed by nobody but the
optimizer), and use W to fill what would otherwise be idle time.

[Note: W placement and memory]
A W is what frees a microbatch's activations (the weight gradient needs the saved
inputs), so deferring W trades memory for bubble. Each order below bounds the
chunk activations a rank holds at once (the simulator's ``peak_inflight``) to the
1F1B level of its placement, v * p chunks for the loop placement and 2p for the V,
plus one for DualPipeV's overlapped pairs, and defers a W only as far as that
bound allows:
- ZB-H1 (loop placement): the interleaved 1F1B order of F and I with a warm-up one
  hop shorter per rank (an I is cheaper than a full B, so fewer forwards keep the
  rank busy), and each W trailing its I by r input gradients on rank r. The last rank runs
  W right after I; rank r keeps r W's in hand to fill the r cooldown slots in which
  it waits for gradients (the ZB-H1 construction of the Zero Bubble paper).
- ZBV: two chunks per rank in a V, in the phases of the paper's ZB-V: a warm-up of
  chunk-0 forwards long enough to reach the turn, then chunk-1 forwards
  interleaved, then the steady state F0 I0 W0 F1 I1 W1, and a cooldown where the
  W's fill the slots left while the gradients drain.
- DualPipeV: the ZBV phases with the steady state as overlapped pairs
  (F of one chunk with the full B of the other, one FB_OVERLAP action, which a
  runtime may run concurrently to hide expert-parallel all-to-all), following
  DeepSeek's DualPipeV construction; the cooldown switches to split I/W halfway.

[Note: choosing among candidate orders]
For few microbatches (m < 2p - 1) the phase construction of ZBV has phases that
run out of microbatches and leave gaps, while a greedy list scheduler (input
gradients first, then forwards nearest the turn, then W) packs them tighter. `zbv`
builds both and keeps the greedy order only when `replay` shows it is no worse in
makespan at equal costs, in makespan with W at half the cost of I, and in peak
activations; otherwise the phase order. The choice is a pure function of (p, m),
so every rank picks the same order.
"""

from __future__ import annotations

from cadence.pipeline.schedule._errors import ScheduleValidationError
from cadence.pipeline.schedule.greedy import greedy_v
from cadence.pipeline.schedule.ir import Action, ActionKind, Schedule
from cadence.pipeline.schedule.orders import (
    check_sizes,
    depth_first,
    loop_placement,
    make_schedule,
    microbatch_groups,
    replay,
    v_placement,
)

__all__ = ["dualpipev", "zb_h1", "zbv"]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741
OVERLAP = ActionKind.FB_OVERLAP


def zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 (v=1) and interleaved zero bubble (v >= 2), any m >= 1.

    See [Note: W placement and memory]; the groups of the interleaved order are
    those of [Note: microbatch groups].
    """
    check_sizes(p, m, v)
    total, first_group = v * m, microbatch_groups(m, p)[0]
    rows = []
    for r in range(p):
        fwd, bwd = depth_first(p, m, v, r)
        warm = min((v - 1) * first_group + (p - 1 - r), total)
        row = [Action(F, *fwd[k]) for k in range(warm)]
        for k in range(total):
            if warm + k < total:
                row.append(Action(F, *fwd[warm + k]))
            row.append(Action(I, *bwd[k]))
            if k >= r:
                row.append(Action(W, *bwd[k - r]))
        row += [Action(W, *bwd[k]) for k in range(max(0, total - r), total)]
        rows.append(row)
    return make_schedule("zb_h1", rows, loop_placement(p, v), v, m)


class _Counters:
    """Per-rank bookkeeping of a V order: next microbatch per (stage, kind), W queue."""

    def __init__(self) -> None:
        self.next: dict[tuple[int, ActionKind], int] = {}
        self.pending_w: list[tuple[int, int]] = []
        self.row: list[Action] = []

    def take(self, stage: int, kind: ActionKind) -> Action:
        # A full B uses the I counter (it stands for its I and W).
        key = (stage, I if kind is B else kind)
        mb = self.next.get(key, 0)
        self.next[key] = mb + 1
        if kind is I:
            self.pending_w.append((stage, mb))
        return Action(kind, stage, mb)

    def add(self, stage: int, kind: ActionKind) -> None:
        self.row.append(self.take(stage, kind))

    def add_w(self, stage: int | None = None) -> None:
        """The oldest pending W (of ``stage`` if given), if there is one."""
        for j, (s, mb) in enumerate(self.pending_w):
            if stage is None or s == stage:
                del self.pending_w[j]
                self.row.append(Action(W, s, mb))
                return

    def add_overlap(self, f_stage: int, b_stage: int) -> None:
        f, b = self.take(f_stage, F), self.take(b_stage, B)
        self.row.append(Action(OVERLAP, f.stage, f.mb, sub=(f, b)))

    def count(self, stage: int, kind: ActionKind) -> int:
        return self.next.get((stage, kind), 0)


def _zbv_phases(p: int, m: int) -> Schedule:
    # Built for max(m, 2p - 1) microbatches (the fewest that fill every phase),
    # then cut to m: an action on a microbatch >= m does not exist.
    n = max(m, 2 * p - 1)
    rows = []
    for r in range(p):
        c, s0, s1 = _Counters(), r, 2 * p - 1 - r
        for _ in range(2 * (p - r) - 1):
            c.add(s0, F)
        for _ in range(r):
            c.add(s1, F)
            c.add(s0, F)
        for _ in range(p - r):
            c.add(s1, F)
            c.add(s1, I)
            c.add_w()
        while c.count(s1, F) < c.count(s0, F) or c.count(s0, F) < n:
            if c.count(s0, F) < n:
                c.add(s0, F)
            c.add(s0, I)
            c.add_w()
            c.add(s1, F)
            c.add(s1, I)
            c.add_w()
        # Cooldown: the first r input gradients of each chunk go without their
        # W, which then fill the slots in which this rank waits for gradients.
        for _ in range(r):
            c.add(s0, I)
            c.add(s1, I)
        for _ in range(p - r):
            c.add(s0, I)
            c.add_w(s0)
        while c.pending_w:
            c.add_w(s1 if any(w[0] == s1 for w in c.pending_w) else s0)
        rows.append([a for a in c.row if a.mb is not None and a.mb < m])
    return make_schedule("zbv", rows, v_placement(p), 2, m)


def zbv(p: int, m: int, v: int = 2) -> Schedule:
    """ZB-V: two chunks per rank in a V (the turn is a LOCAL hand-off), I/W split.

    See [Note: W placement and memory] and [Note: choosing among candidate orders].
    """
    check_sizes(p, m)
    if v != 2:
        raise ScheduleValidationError(f"zbv is V-shaped with exactly 2 chunks per rank, got v={v}")
    phases = _zbv_phases(p, m)
    if m >= 2 * p - 1:
        return phases
    greedy = greedy_v(p, m)
    return greedy if _no_worse(greedy, phases) else phases


def _no_worse(a: Schedule, b: Schedule) -> bool:
    eq_a, peak_a = replay(a)
    eq_b, peak_b = replay(b)
    return eq_a <= eq_b and peak_a <= peak_b and replay(a, w=0.5)[0] <= replay(b, w=0.5)[0]


def dualpipev(p: int, m: int, v: int = 2) -> Schedule:
    """DualPipeV: V placement; in steady state a forward of one chunk is paired with
    a full backward of the other as one FB_OVERLAP action. See [Note: W placement
    and memory].
    """
    check_sizes(p, m)
    if v != 2:
        raise ScheduleValidationError(
            f"dualpipev is V-shaped with exactly 2 chunks per rank, got v={v}"
        )
    if m < 2 * p:
        raise ScheduleValidationError(f"dualpipev needs m >= 2p microbatches (got m={m}, p={p})")
    rows = []
    for r in range(p):
        c, s0, s1 = _Counters(), r, 2 * p - 1 - r
        for _ in range(2 * (p - r - 1)):
            c.add(s0, F)
        for _ in range(r + 1):
            c.add(s0, F)
            c.add(s1, F)
        for _ in range(p - r - 1):
            c.add(s1, I)
            c.add_w()
            c.add(s1, F)
        for step in range(m - 2 * p + r + 1):
            if step == 0 and r == p - 1:
                # The last rank's first pair would wait on its own F1: run it split.
                c.add(s0, F)
                c.add(s1, B)
            else:
                c.add_overlap(s0, s1)
            c.add_overlap(s1, s0)
        for _ in range(p - r - 1):
            c.add(s1, B)
            c.add_overlap(s1, s0)
        # Drain: full backwards first, split I/W from the middle on, so that the
        # W's fill the slots in which the last gradients travel.
        split = False
        for step in range(r + 1):
            if step == (r + 1) // 2 and r % 2 == 1:
                split = True
            c.add(s1, I if split else B)
            if step == (r + 1) // 2 and r % 2 == 0:
                split = True
            c.add(s0, I if split else B)
        for _ in range(p - r - 1):
            c.add_w()
            c.add(s0, I if split else B)
        while c.pending_w:
            c.add_w()
        rows.append(c.row)
    return make_schedule("dualpipev", rows, v_placement(p), 2, m)
