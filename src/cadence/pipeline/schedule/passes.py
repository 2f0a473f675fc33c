"""Lowering passes: from a compute-only schedule to the one the runtime executes.

``lower`` runs, in order:
1. `validate_compute` (``validate.py``): the compute rules.
2. `add_comms`: a SEND right after each cross-rank producer, a LOCAL right after
   each same-rank producer (the V turn, consecutive stages on one rank), and a
   RECV per SEND on the consumer's rank, just before its consumer but never after
   a later-sequence RECV on the same channel. Every SEND/RECV gets
   ``channel = (src_rank, dst_rank)`` and ``seq``. See [Note: receives in FIFO order].
3. `order_comms`: puts every rank's SENDs and RECVs into one global message order;
   see [Note: one global message order].
4. ``dp_passes``: `add_reduce_grad` / `add_wait_reduce` (the data-parallel
   reduction and its deferred wait) and, when asked, `add_unshard_reshard`.
5. `validate_lowered` (``validate.py``): the lowered rules. The simulator
   (``sim.verify``) is the final gate, run by the runtime before any group exists.

`apply_parity_rule` and `repair_deadlocks` (``sim.py``) remain as standalone
passes for hand-lowered schedules; `lower` needs neither, since a global order
already rules out the cycles they break.

`complete_comms` is the entry for a schedule lowered elsewhere (torch pipelining's
``SEND_F``/``RECV_B`` lists): it adds what cadence's IR states and torch's leaves
implicit (channels, sequence numbers, LOCAL hand-offs), so the same simulator and
the same executor serve both.

[Note: receives in FIFO order]
Each channel (a directed rank pair) is one FIFO: gloo and NCCL match the i-th
send on a communicator with the i-th receive posted for that peer, whatever the
receive was meant to carry. If a rank posted RECV(mb 1) before RECV(mb 0) while
its peer sent mb 0 first, microbatch 1's buffer would silently receive microbatch
0's data (gloo reports no error). So every SEND gets the next sequence number of
its channel in the sender's program order, its RECV gets the same number, and a
RECV is never placed after a higher-numbered RECV of the same channel.

[Note: the parity rule]
Two ranks that each post a SEND to the other before their RECV from it can block
in a cycle when sends rendezvous (gloo always, NCCL once its buffers are full).
Within each run of comm actions between two computes, a lower rank therefore posts
its RECVs from a higher-ranked peer before its SENDs, and the higher rank keeps its
SENDs first: one side of every pair always receives first. This is Megatron's
even/odd ordering, and torch's ``_defer_recv_ops`` rule (pytorch/pytorch#178815),
which fixed the two-node deadlock of naively deferred receives reported in
pytorch/pytorch#172668.

[Note: one global message order]
A communicator (NCCL's, and gloo's per peer) runs a rank's operations on it in
the order they were posted, so a receive can wait behind a send to another rank
that waits for that rank's own receive, and so on around a cycle. With one
communicator per directed rank pair only a channel's own FIFO orders anything; with
one per direction, or one shared by all, the order in which each rank posts
unrelated transfers matters (pytorch/pytorch#195760; receives posted just before
their consumers deadlocked 182 of 215 of cadence's lowered generator schedules in
the simulator on one shared communicator, 127 on per-direction ones).
`order_comms` removes the hazard at its root. It times the compute order once
(unit costs: F = I = W = 1, B = 2, `compute_times`), gives every message the
time its producer ends, and sorts all messages of the step by (time, src stage,
dst stage, payload, microbatch): one global order, the same on every rank. Each
rank posts its SENDs and RECVs in that order: a SEND right after its producer, a
RECV after every compute of its rank that ends by the message's time (so still
before its consumer, which cannot start earlier). Then every rank's transfers
are a subsequence of one global sequence, consistent with its computes, and
message k can always complete once messages 0..k-1 have: its producer and every
compute before either endpoint's post need only messages sent earlier. That holds
under any durations and any grouping of channels into communicators (per
directed edge, per direction, or one shared), which the simulator checks for
every generator. Sequence numbers are then renumbered in the new sender order.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter

from cadence.pipeline.schedule._errors import ScheduleValidationError
from cadence.pipeline.schedule.dp_passes import (
    add_reduce_grad,
    add_unshard_reshard,
    add_wait_reduce,
)
from cadence.pipeline.schedule.ir import Action, ActionKind, Payload, Schedule
from cadence.pipeline.schedule.orders import compute_times
from cadence.pipeline.schedule.validate import (
    Edge,
    inputs_of,
    outputs_of,
    validate_compute,
    validate_lowered,
)

__all__ = [
    "add_comms",
    "add_reduce_grad",
    "add_wait_reduce",
    "apply_parity_rule",
    "complete_comms",
    "lower",
    "order_comms",
]

Channel = tuple[int, int]
# A message as the fields of its SEND or RECV name it: (src stage, dst stage, payload,
# microbatch), then the slot for a transfer. Optional as on Action, though every
# transfer has them (Action.__post_init__).
_Message = tuple[int | None, int | None, Payload | None, int | None]
_TransferKey = tuple[int | None, int | None, Payload | None, int | None, int]


# -- lowering --------------------------------------------------------------------


def add_comms(sched: Schedule) -> Schedule:
    """Insert SEND/LOCAL after producers and RECV before consumers, with seq numbers."""
    if sched.meta.lowered:
        raise ScheduleValidationError(
            "add_comms takes a compute-only schedule; this one is already lowered"
        )
    validate_compute(sched)
    n, place = sched.num_stages, sched.placement
    rows: list[list[Action]] = [[] for _ in sched.ranks]
    seq: Counter[tuple[int, int]] = Counter()
    send_seq: dict[Edge, tuple[tuple[int, int], int]] = {}
    # Pass 1: producer side. Sequence numbers follow the sender's program order.
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            rows[r].append(a)
            for src, dst, payload, mb in outputs_of(a, n):
                if place[dst] == r:
                    rows[r].append(
                        Action(ActionKind.LOCAL, src, mb, peer_stage=dst, payload=payload)
                    )
                else:
                    ch = (r, place[dst])
                    rows[r].append(
                        Action(
                            ActionKind.SEND,
                            src,
                            mb,
                            peer_stage=dst,
                            payload=payload,
                            channel=ch,
                            seq=seq[ch],
                        )
                    )
                    send_seq[(src, dst, payload, mb)] = (ch, seq[ch])
                    seq[ch] += 1
    # Pass 2: consumer side. RECV k on a channel goes before its consumer and
    # before RECV k+1 on the same channel. See [Note: receives in FIFO order].
    out: list[list[Action]] = []
    for r, row in enumerate(rows):
        want: dict[int, list[Action]] = {}  # insert before row index -> RECVs
        by_channel: dict[tuple[int, int], list[tuple[int, int, Action]]] = {}
        for i, a in enumerate(row):
            if a.is_compute:
                for src, dst, payload, mb in inputs_of(a, n):
                    if place[src] != r:
                        ch, sq = send_seq[(src, dst, payload, mb)]
                        recv = Action(
                            ActionKind.RECV,
                            dst,
                            mb,
                            peer_stage=src,
                            payload=payload,
                            channel=ch,
                            seq=sq,
                        )
                        by_channel.setdefault(ch, []).append((sq, i, recv))
        for items in by_channel.values():
            items.sort(key=lambda x: x[0])
            bound = len(row)
            for _sq, i, recv in reversed(items):
                bound = min(bound, i)
                want.setdefault(bound, []).append(recv)
        new: list[Action] = []
        for i in range(len(row) + 1):
            new.extend(sorted(want.get(i, []), key=lambda x: (x.channel, x.seq)))
            if i < len(row):
                new.append(row[i])
        out.append(new)
    return sched.with_ranks(out, lowered=True)


def complete_comms(sched: Schedule) -> Schedule:
    """Fill in what a schedule lowered by torch pipelining leaves implicit.

    torch's lowered lists (``get_schedule_ops(..., with_comms=True)``, or a
    ``compute_comms`` CSV) carry SEND/RECV with implied peers, but no channels, no
    sequence numbers, and no action at all for a hand-off between two stages on one
    rank. This adds them as cadence's own lowering does: a LOCAL right after each
    same-rank producer, ``channel = (src_rank, dst_rank)`` on every SEND and RECV,
    and per-channel sequence numbers in the sender's program order (a RECV takes
    the number of the SEND it matches). Reduction waits follow [Note: torch's
    reduction waits]; torch 2.15's WAIT_SEND_F/B are cadence's WAIT_SEND
    and stay where torch put them. Every action of torch's list keeps its place; the
    completion only adds. The result is then validated and simulated like any
    lowered schedule: a torch list whose receives are out of FIFO order is
    refused, not run (see [Note: receives in FIFO order]).

    [Note: torch's reduction waits]
    torch 2.13 lowers a stage's data-parallel reduction as one blocking
    REDUCE_GRAD and has no wait action, so completion gives each REDUCE_GRAD its
    WAIT_REDUCE_GRAD right after it: the same timing, in cadence's issue + wait
    form. torch 2.15 splits it as cadence does: REDUCE_GRAD starts the reduction
    (FSDP: ``start_gradient_reduction``) and WAIT_REDUCE_GRAD(stage) waits for it
    (``wait_for_gradient_reduction``), placed by ``_add_reduce_grad`` right after
    its REDUCE_GRAD (the default; RECVs lowered later may land between them) or,
    with ``defer_reduce_grad_wait=True``, just before the rank's next REDUCE_GRAD
    or at the end of its list (at most one in flight). That is exactly cadence's
    WAIT_REDUCE_GRAD (see [Note: deferred gradient reduction] in
    ``dp_passes.py``), so it is imported as one, where torch put it. (torch still
    reduces a non-FSDP stage synchronously at REDUCE_GRAD and does nothing at its
    wait; cadence issues every wrapper's reduction at REDUCE_GRAD and waits at the
    wait, and no action between the two reads the reduced gradients.) Which form a
    list is in is read from the list itself, not from the installed torch (a CSV
    may come from another version): one with any WAIT_REDUCE_GRAD carries all its
    waits (a REDUCE_GRAD left without one is then an error that `validate_lowered`
    names), one without any is the blocking form. Adding a wait to a list that has
    its own would wait twice, which the validator refuses as a duplicate.
    """
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            # LOCAL and channel/seq numbers are what this pass adds; a list that
            # has them was completed (or lowered by cadence) already. Reduction
            # waits are not among them: torch 2.15 emits its own.
            if a.kind is ActionKind.LOCAL or (
                a.kind in (ActionKind.SEND, ActionKind.RECV)
                and (a.seq is not None or a.channel is not None)
            ):
                raise ScheduleValidationError(
                    f"rank {r}: {a} already has cadence's fields (LOCAL, channel or #seq); "
                    "complete_comms takes torch's lowered format, and a cadence lowered "
                    "schedule needs no completion"
                )
    # See [Note: torch's reduction waits].
    blocking_reduce = not any(
        a.kind is ActionKind.WAIT_REDUCE_GRAD for acts in sched.ranks for a in acts
    )
    n, place = sched.num_stages, sched.placement
    seq: Counter[Channel] = Counter()
    numbered: dict[_TransferKey, tuple[Channel, int]] = {}
    rows: list[list[Action]] = []
    for r, acts in enumerate(sched.ranks):
        row: list[Action] = []
        for a in acts:
            if a.kind is ActionKind.SEND:
                ch = (r, place[a.peer_stage])  # type: ignore[index]  # Action.__post_init__ sets a transfer's peer and payload; Optional on Action
                numbered[(a.stage, a.peer_stage, a.payload, a.mb, a.slot)] = (ch, seq[ch])
                a = a.linked(ch, seq[ch])
                seq[ch] += 1
            row.append(a)
            if a.kind is ActionKind.REDUCE_GRAD and blocking_reduce:
                # torch 2.13's REDUCE_GRAD blocks until the reduction is done.
                row.append(Action(ActionKind.WAIT_REDUCE_GRAD, a.stage))
            for src, dst, payload, mb in outputs_of(a, n) if a.is_compute else ():
                if place[dst] == r:
                    row.append(Action(ActionKind.LOCAL, src, mb, peer_stage=dst, payload=payload))
        rows.append(row)
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            if a.kind is ActionKind.RECV:
                key = (a.peer_stage, a.stage, a.payload, a.mb, a.slot)
                hit = numbered.get(key)
                # A RECV with no SEND keeps seq None; validate_lowered names it.
                ch, sq = hit if hit is not None else ((place[a.peer_stage], r), None)  # type: ignore[index]  # seq None for an unmatched RECV (see above)
                row[i] = a.linked(ch, sq)
    return sched.with_ranks(rows, lowered=True)


def apply_parity_rule(sched: Schedule) -> Schedule:
    """Reorder each run of comm actions; see [Note: the parity rule]."""
    out = []
    for r, acts in enumerate(sched.ranks):
        new: list[Action] = []
        run: list[Action] = []
        for a in [*acts, None]:
            if a is not None and a.kind in (ActionKind.SEND, ActionKind.RECV):
                run.append(a)
                continue
            # Stable: a RECV from a higher-ranked peer moves ahead of SENDs in the run.
            first = [x for x in run if x.kind is ActionKind.RECV and _src_rank(sched, x) > r]
            new.extend(first + [x for x in run if x not in first])
            run = []
            if a is not None:
                new.append(a)
        out.append(new)
    return sched.with_ranks(out)


def _src_rank(sched: Schedule, a: Action) -> int:
    if a.channel is not None:
        return a.channel[0]
    return sched.placement[a.peer_stage] if a.peer_stage is not None else -1


def order_comms(sched: Schedule) -> Schedule:
    """Post every rank's SENDs and RECVs in one global message order.

    Takes `add_comms`' output; see [Note: one global message order].
    """
    if not sched.meta.lowered:
        raise ScheduleValidationError("order_comms takes a lowered schedule (run add_comms first)")
    n = sched.num_stages
    times = compute_times(
        sched, {ActionKind.F: 1, ActionKind.I: 1, ActionKind.W: 1, ActionKind.B: 2}
    )
    ready: dict[_Message, float] = {}  # message -> the end of its producer
    for r, acts in enumerate(sched.ranks):
        for a, (_, end) in zip((a for a in acts if a.is_compute), times[r], strict=True):
            for edge in outputs_of(a, n):
                ready[edge] = end

    def order(a: Action) -> tuple[float, int | None, int | None, str, int | None, int]:
        src, dst = (a.peer_stage, a.stage) if a.kind is ActionKind.RECV else (a.stage, a.peer_stage)
        t = ready[(src, dst, a.payload, a.mb)]
        return (t, src, dst, a.payload.value, a.mb, a.slot)  # type: ignore[union-attr]  # Action.__post_init__ sets a transfer's peer and payload; Optional on Action

    rows: list[list[Action]] = []
    for r, acts in enumerate(sched.ranks):
        ends = [end for _, end in times[r]]
        # gaps[j]: the transfers posted after the rank's j-th compute (0: before any).
        gaps: list[list[Action]] = [[] for _ in range(len(ends) + 1)]
        for a in acts:
            if a.kind in (ActionKind.SEND, ActionKind.RECV):
                gaps[bisect_right(ends, order(a)[0])].append(a)
        row = sorted(gaps[0], key=order)
        j = 0
        for a in acts:
            if a.kind in (ActionKind.SEND, ActionKind.RECV):
                continue
            if a.is_compute:
                j += 1
                row.append(a)
                row.extend(sorted(gaps[j], key=order))
            else:
                # LOCAL and markers stay right after the compute they followed.
                row.insert(len(row) - len(gaps[j]), a)
        rows.append(row)
    return _renumber(sched.with_ranks(rows))


def _renumber(sched: Schedule) -> Schedule:
    """Sequence numbers again, in each sender's (new) program order."""
    seq: Counter[Channel] = Counter()
    numbered: dict[_TransferKey, int] = {}
    for acts in sched.ranks:
        for a in acts:
            if a.kind is ActionKind.SEND:
                numbered[(a.stage, a.peer_stage, a.payload, a.mb, a.slot)] = seq[a.channel]  # type: ignore[index]  # lowered: every transfer has its channel (validate_lowered); Optional on Action
                seq[a.channel] += 1  # type: ignore[index]  # lowered: every transfer has its channel (validate_lowered); Optional on Action
    rows = [
        [
            a.linked(a.channel, numbered[(a.stage, a.peer_stage, a.payload, a.mb, a.slot)])
            if a.kind is ActionKind.SEND
            else a.linked(a.channel, numbered[(a.peer_stage, a.stage, a.payload, a.mb, a.slot)])
            if a.kind is ActionKind.RECV
            else a
            for a in acts
        ]
        for acts in sched.ranks
    ]
    return sched.with_ranks(rows)


def lower(
    sched: Schedule,
    *,
    reduce_grad: bool = True,
    max_outstanding_reductions: int = 1,
    unshard_lookahead: int | None = None,
) -> Schedule:
    """Compute-only -> the lowered schedule the runtime executes (see the module docstring).

    Args:
        reduce_grad: add REDUCE_GRAD / WAIT_REDUCE_GRAD (False: a schedule for an
            accumulation step, which reduces nothing).
        max_outstanding_reductions: K, the reductions a rank keeps in flight
            before it waits for the oldest (`add_wait_reduce`).
        unshard_lookahead: if given, add UNSHARD / RESHARD per stage with this
            prefetch distance in compute actions (`add_unshard_reshard`); None
            leaves parameter residency to the stage wrappers.
    """
    low = order_comms(add_comms(sched))
    if reduce_grad:
        low = add_wait_reduce(add_reduce_grad(low), max_outstanding=max_outstanding_reductions)
    if unshard_lookahead is not None:
        low = add_unshard_reshard(low, lookahead=unshard_lookahead)
    validate_lowered(low)
    return low
