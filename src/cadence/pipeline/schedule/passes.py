"""Lowering passes: from a compute-only schedule to the one the runtime executes.

``lower`` runs, in order:
1. `validate_compute` (``validate.py``): the compute rules.
2. `add_comms`: a SEND right after each cross-rank producer, a LOCAL right after
   each same-rank producer (the V turn, consecutive stages on one rank), and a
   RECV per SEND on the consumer's rank, just before its consumer but never after
   a later-sequence RECV on the same channel. Every SEND/RECV gets
   ``channel = (src_rank, dst_rank)`` and ``seq``. See [Note: receives in FIFO order].
3. `apply_parity_rule`: see [Note: the parity rule].
4. `repair_deadlocks` (``sim.py``): hoists receives that a blocked rendezvous send
   waits for. It lives beside the simulator it runs, so passes -> sim is one-way.
5. `add_reduce_grad` / `add_wait_reduce`: see [Note: deferred gradient reduction].
6. `validate_lowered` (``validate.py``): the lowered rules. The simulator
   (``sim.verify``) is the final gate, run by the runtime before any group exists.

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

[Note: deferred gradient reduction]
A stage's gradients are final after its last B or W of the step, so REDUCE_GRAD
(issue the data-parallel reduction, asynchronously) goes right after it, while the
other local stages still compute. WAIT_REDUCE_GRAD goes just before the next local
REDUCE_GRAD, or at the end of the rank's list: at most one reduction per rank is
in flight, which bounds the memory of reduction buffers, and each one overlaps the
compute that follows it. ``max_outstanding=K`` lets K be in flight (the oldest is
waited when a (K+1)-th is issued; the rest at the end), trading buffers for overlap.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from cadence.pipeline.schedule.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleValidationError,
)
from cadence.pipeline.schedule.sim import repair_deadlocks
from cadence.pipeline.schedule.validate import (
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
]

K = ActionKind
Channel = tuple[int, int]


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
    send_seq: dict[tuple, tuple[tuple[int, int], int]] = {}
    # Pass 1: producer side. Sequence numbers follow the sender's program order.
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            rows[r].append(a)
            for src, dst, payload, mb in outputs_of(a, n):
                if place[dst] == r:
                    rows[r].append(Action(K.LOCAL, src, mb, peer_stage=dst, payload=payload))
                else:
                    ch = (r, place[dst])
                    rows[r].append(
                        Action(
                            K.SEND,
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
                            K.RECV, dst, mb, peer_stage=src, payload=payload, channel=ch, seq=sq
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
    the number of the SEND it matches). The result is then validated and
    simulated like any lowered schedule: a torch list whose receives are out of
    FIFO order is refused, not run (see [Note: receives in FIFO order]).
    """
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            if a.kind is K.LOCAL or (a.kind in (K.SEND, K.RECV) and a.seq is not None):
                raise ScheduleValidationError(
                    f"rank {r}: {a} already has cadence's fields (LOCAL or #seq); "
                    "complete_comms takes torch's lowered format, and a cadence lowered "
                    "schedule needs no completion"
                )
    n, place = sched.num_stages, sched.placement
    seq: Counter[Channel] = Counter()
    numbered: dict[tuple, tuple[Channel, int]] = {}
    rows: list[list[Action]] = []
    for r, acts in enumerate(sched.ranks):
        row: list[Action] = []
        for a in acts:
            if a.kind is K.SEND:
                ch = (r, place[a.peer_stage])  # type: ignore[index]
                numbered[(a.stage, a.peer_stage, a.payload, a.mb, a.slot)] = (ch, seq[ch])
                a = replace(a, channel=ch, seq=seq[ch])
                seq[ch] += 1
            row.append(a)
            for src, dst, payload, mb in outputs_of(a, n) if a.is_compute else ():
                if place[dst] == r:
                    row.append(Action(K.LOCAL, src, mb, peer_stage=dst, payload=payload))
        rows.append(row)
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            if a.kind is K.RECV:
                key = (a.peer_stage, a.stage, a.payload, a.mb, a.slot)
                ch, sq = numbered.get(key, ((place[a.peer_stage], r), None))  # type: ignore[index]
                # A RECV with no SEND keeps seq None; validate_lowered names it.
                row[i] = replace(a, channel=ch, seq=sq)
    return sched.with_ranks(rows, lowered=True)


def apply_parity_rule(sched: Schedule) -> Schedule:
    """Reorder each run of comm actions; see [Note: the parity rule]."""
    out = []
    for r, acts in enumerate(sched.ranks):
        new: list[Action] = []
        run: list[Action] = []
        for a in [*acts, None]:
            if a is not None and a.kind in (K.SEND, K.RECV):
                run.append(a)
                continue
            # Stable: a RECV from a higher-ranked peer moves ahead of SENDs in the run.
            first = [x for x in run if x.kind is K.RECV and _src_rank(sched, x) > r]
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


def add_reduce_grad(sched: Schedule) -> Schedule:
    """REDUCE_GRAD(stage) right after the stage's last B or W on its rank.

    See [Note: deferred gradient reduction].
    """
    out = []
    for acts in sched.ranks:
        last: dict[int, int] = {}
        for i, a in enumerate(acts):
            for c in a.compute_parts():
                if c.kind in (K.B, K.W):
                    last[c.stage] = i
        new: list[Action] = []
        for i, a in enumerate(acts):
            new.append(a)
            new.extend(Action(K.REDUCE_GRAD, s) for s in sorted(last) if last[s] == i)
        out.append(new)
    return sched.with_ranks(out)


def add_wait_reduce(sched: Schedule, max_outstanding: int = 1) -> Schedule:
    """WAIT_REDUCE_GRAD(stage) before the REDUCE_GRAD that would put more than
    ``max_outstanding`` in flight (for the oldest), and at the end for the rest.

    See [Note: deferred gradient reduction].
    """
    if max_outstanding < 1:
        raise ScheduleValidationError(
            f"max_outstanding={max_outstanding}: at least one reduction must be in flight "
            "(1 waits each just before the next is issued)"
        )
    out = []
    for acts in sched.ranks:
        new: list[Action] = []
        pending: list[int] = []
        for a in acts:
            if a.kind is K.REDUCE_GRAD:
                while len(pending) >= max_outstanding:
                    new.append(Action(K.WAIT_REDUCE_GRAD, pending.pop(0)))
                pending.append(a.stage)
            new.append(a)
        new.extend(Action(K.WAIT_REDUCE_GRAD, s) for s in pending)
        out.append(new)
    return sched.with_ranks(out)


def lower(
    sched: Schedule,
    *,
    reduce_grad: bool = True,
    parity: bool = True,
    repair: bool = True,
    max_outstanding: int = 1,
) -> Schedule:
    """Compute-only -> the lowered schedule the runtime executes (see the module docstring).

    ``max_outstanding``: data-parallel reductions in flight per rank (see [Note:
    deferred gradient reduction]).
    """
    low = add_comms(sched)
    if parity:
        low = apply_parity_rule(low)
    if repair:
        low = repair_deadlocks(low)
    if reduce_grad:
        low = add_wait_reduce(add_reduce_grad(low), max_outstanding)
    validate_lowered(low)
    return low
