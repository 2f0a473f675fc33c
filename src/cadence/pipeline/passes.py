"""Validation and lowering passes over the schedule IR.

Pipeline of passes (``lower`` runs them in this order):
1. `validate_compute`: counts, per-rank order (F before I/B, I before W), one rank
   per stage, microbatches in range.
2. `add_comms`: a SEND right after each cross-rank producer, a LOCAL right after
   each same-rank producer (the V turn, consecutive stages on one rank), and a
   RECV per SEND on the consumer's rank, just before its consumer but never after
   a later-sequence RECV on the same channel (receives are posted in FIFO order).
   Every SEND/RECV gets ``channel = (src_rank, dst_rank)`` and ``seq``.
3. `apply_parity_rule`: within each run of comm actions between two computes, a
   lower rank posts its RECVs from a higher peer before its SENDs to it (Megatron's
   even/odd rule, torch's ``_defer_recv_ops`` #178815). Fixes #172668.
4. `repair_deadlocks`: run the structural simulator with rendezvous sends; while
   some SEND waits for a RECV the peer has not posted, hoist that RECV to the
   peer's blocked point. RECVs never block, so each hoist makes progress.
5. Optional `add_reduce_grad` / `add_wait_reduce` (and room for UNSHARD/RESHARD).

`validate_lowered` checks the lowered rules (RECV without SEND, unconsumed RECV,
WAIT_REDUCE_GRAD before REDUCE_GRAD, ...). The simulator (``sim.verify``) is the
final gate.
"""

from __future__ import annotations

from collections import Counter

from cadence.pipeline.ir import Action, ActionKind, Payload, Schedule, ScheduleValidationError

__all__ = [
    "add_comms",
    "add_reduce_grad",
    "add_wait_reduce",
    "apply_parity_rule",
    "inputs_of",
    "lower",
    "outputs_of",
    "repair_deadlocks",
    "validate_compute",
    "validate_lowered",
]

K = ActionKind
_COMM = (K.SEND, K.RECV, K.LOCAL, K.WAIT_SEND)


def _err(msg: str) -> ScheduleValidationError:
    return ScheduleValidationError(msg)


# -- dataflow of compute actions -------------------------------------------------


def inputs_of(a: Action, n_stages: int) -> list[tuple[int, int, Payload, int]]:
    """(producer stage, consumer stage, payload, mb) inputs of a compute action."""
    out = []
    for c in a.compute_parts():
        assert c.mb is not None
        if c.kind is K.F and c.stage > 0:
            out.append((c.stage - 1, c.stage, Payload.ACT, c.mb))
        elif c.kind in (K.B, K.I) and c.stage + 1 < n_stages:
            out.append((c.stage + 1, c.stage, Payload.GRAD, c.mb))
    return out


def outputs_of(a: Action, n_stages: int) -> list[tuple[int, int, Payload, int]]:
    """(producer stage, consumer stage, payload, mb) outputs of a compute action."""
    out = []
    for c in a.compute_parts():
        assert c.mb is not None
        if c.kind is K.F and c.stage + 1 < n_stages:
            out.append((c.stage, c.stage + 1, Payload.ACT, c.mb))
        elif c.kind in (K.B, K.I) and c.stage > 0:
            out.append((c.stage, c.stage - 1, Payload.GRAD, c.mb))
    return out


# -- validation ------------------------------------------------------------------


def validate_compute(sched: Schedule, m: int | None = None) -> None:
    """Check the compute actions; raise `ScheduleValidationError` naming the rule."""
    m = sched.meta.m if m is None else m
    n = sched.num_stages
    if m <= 0:
        raise _err("the schedule has no microbatches (meta.m == 0 and no compute actions)")
    counts: Counter[tuple[K, int, int]] = Counter()
    for r, acts in enumerate(sched.ranks):
        seen: set[tuple[K, int, int]] = set()
        for i, a in enumerate(acts):
            for c in a.compute_parts():
                assert c.mb is not None
                where = f"rank {r}, action {i} ({c})"
                if sched.placement[c.stage] != r:
                    raise _err(
                        f"{where}: stage {c.stage} is placed on rank {sched.placement[c.stage]} "
                        f"but computes on rank {r}; a stage must live on exactly one rank"
                    )
                if c.mb >= m:
                    raise _err(f"{where}: microbatch {c.mb} is out of range 0..{m - 1}")
                key = (c.kind, c.stage, c.mb)
                if key in seen:
                    raise _err(f"{where}: {c} runs twice")
                if c.kind in (K.B, K.I) and (K.F, c.stage, c.mb) not in seen:
                    what = "Full backward" if c.kind is K.B else "Input backward"
                    raise _err(
                        f"{where}: {what} of stage {c.stage}, microbatch {c.mb} without first "
                        f"running its forward (B before F)"
                    )
                if c.kind is K.W and (K.I, c.stage, c.mb) not in seen:
                    raise _err(
                        f"{where}: weight backward of stage {c.stage}, microbatch {c.mb} before "
                        f"its input backward (W before I)"
                    )
                if c.kind is K.I and (K.B, c.stage, c.mb) in seen:
                    raise _err(f"{where}: microbatch has both a full B and an I/W split")
                seen.add(key)
                counts[key] += 1
    for s in range(n):
        for k in range(m):
            if not counts[(K.F, s, k)]:
                raise _err(
                    f"stage {s} (rank {sched.placement[s]}) is missing the forward of microbatch {k}"
                )
            full, inp, wgt = counts[(K.B, s, k)], counts[(K.I, s, k)], counts[(K.W, s, k)]
            if full == 0 and inp == 0:
                raise _err(
                    f"stage {s} (rank {sched.placement[s]}) is missing the backward of microbatch {k}"
                )
            if inp and not wgt:
                raise _err(
                    f"stage {s}, microbatch {k}: I without its W (the weight gradient is never computed)"
                )


def validate_lowered(sched: Schedule) -> None:
    """Check the lowered rules: pairing of SEND/RECV, consumption, LOCAL, waits."""
    validate_compute(sched)
    n = sched.num_stages
    sends: dict[tuple, tuple[int, int, Action]] = {}
    recvs: dict[tuple, tuple[int, int, Action]] = {}
    for r, acts in enumerate(sched.ranks):
        have: set[tuple] = set()  # inputs provided by an earlier RECV/LOCAL
        produced: set[tuple] = set()
        issued_reduce: set[int] = set()
        for i, a in enumerate(acts):
            where = f"rank {r}, action {i} ({a})"
            if a.kind in _COMM:
                peer = a.peer_stage if a.peer_stage is not None else a.default_peer
                if peer is None or not 0 <= peer < n:
                    raise _err(f"{where}: peer stage {peer} is not a stage of this schedule")
                src, dst = (peer, a.stage) if a.kind is K.RECV else (a.stage, peer)
                key = (src, dst, a.payload, a.mb, a.slot)
                same = sched.placement[src] == sched.placement[dst]
                if a.kind is K.LOCAL:
                    if not same:
                        raise _err(
                            f"{where}: LOCAL between stages on ranks {sched.placement[src]} and {sched.placement[dst]}; use SEND/RECV"
                        )
                    if key[:4] not in produced:
                        raise _err(f"{where}: LOCAL before its producer ran on this rank")
                    have.add(key)
                elif same:
                    raise _err(
                        f"{where}: {a.kind.name} between stages {src} and {dst} on the same rank; use LOCAL"
                    )
                elif a.kind is K.SEND:
                    if key[:4] not in produced:
                        raise _err(
                            f"{where}: SEND before its producer ({src}{'F' if a.payload is Payload.ACT else 'B/I'}{a.mb}) ran"
                        )
                    if key in sends:
                        raise _err(f"{where}: duplicate SEND")
                    sends[key] = (r, i, a)
                elif a.kind is K.RECV:
                    if key in recvs:
                        raise _err(f"{where}: duplicate RECV")
                    recvs[key] = (r, i, a)
                    have.add(key)
            elif a.is_compute:
                for key in inputs_of(a, n):
                    if (*key, 0) not in have:
                        raise _err(
                            f"{where}: consumes the {key[2].name.lower()} of stage {key[0]}, "
                            f"microbatch {key[3]}, but no earlier RECV or LOCAL on rank {r} provides it"
                        )
                    have.discard((*key, 0))
                produced.update(outputs_of(a, n))
            elif a.kind is K.REDUCE_GRAD:
                issued_reduce.add(a.stage)
            elif a.kind is K.WAIT_REDUCE_GRAD:
                if a.stage not in issued_reduce:
                    raise _err(
                        f"{where}: WAIT_REDUCE_GRAD for stage {a.stage} before its REDUCE_GRAD"
                    )
                issued_reduce.discard(a.stage)
        for key in sorted(have, key=str):
            src, dst, payload, mb, _ = key
            raise _err(
                f"rank {r}: the {payload.name.lower()} of stage {src} -> {dst}, microbatch {mb} is "
                "received or handed over but never consumed (unconsumed RECV)"
            )
    for key, (r, i, a) in recvs.items():
        if key not in sends:
            raise _err(
                f"rank {r}, action {i} ({a}): RECV without a matching SEND on rank {sched.placement[key[0]]}"
            )
    for key, (r, i, a) in sends.items():
        if key not in recvs:
            raise _err(
                f"rank {r}, action {i} ({a}): SEND without a matching RECV on rank {sched.placement[key[1]]}"
            )


# -- lowering --------------------------------------------------------------------


def add_comms(sched: Schedule) -> Schedule:
    """Insert SEND/LOCAL after producers and RECV before consumers, with seq numbers."""
    if sched.meta.lowered:
        raise ValueError("add_comms takes a compute-only schedule; this one is already lowered")
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
    # before RECV k+1 on the same channel, so receives are posted in FIFO order.
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


def apply_parity_rule(sched: Schedule) -> Schedule:
    """In each run of comm actions, the lower rank posts RECVs from a higher peer
    before SENDs to that peer (and the higher rank keeps SENDs first)."""
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
    peer = a.peer_stage if a.peer_stage is not None else a.default_peer
    return sched.placement[peer] if peer is not None else -1


def repair_deadlocks(sched: Schedule, *, max_moves: int | None = None) -> Schedule:
    """Hoist RECVs that a blocked rendezvous SEND waits for (see module docstring)."""
    from cadence.pipeline.sim import _structural_blocked_send

    rows = [list(r) for r in sched.ranks]
    limit = max_moves if max_moves is not None else sum(len(r) for r in rows) + 1
    for _ in range(limit):
        cur = sched.with_ranks(rows)
        hit = _structural_blocked_send(cur)
        if hit is None:
            return cur
        peer, peer_pc, recv_index = hit
        recv = rows[peer].pop(recv_index)
        rows[peer].insert(peer_pc, recv)
    raise ScheduleValidationError("could not make the schedule deadlock-free by hoisting receives")


def add_reduce_grad(sched: Schedule) -> Schedule:
    """REDUCE_GRAD(stage) right after the stage's last B or W on its rank."""
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


def add_wait_reduce(sched: Schedule) -> Schedule:
    """WAIT_REDUCE_GRAD(stage) just before the next local REDUCE_GRAD, or at the end
    (so at most one reduction is outstanding per rank)."""
    out = []
    for acts in sched.ranks:
        new: list[Action] = []
        pending: int | None = None
        for a in acts:
            if a.kind is K.REDUCE_GRAD:
                if pending is not None:
                    new.append(Action(K.WAIT_REDUCE_GRAD, pending))
                pending = a.stage
            new.append(a)
        if pending is not None:
            new.append(Action(K.WAIT_REDUCE_GRAD, pending))
        out.append(new)
    return sched.with_ranks(out)


def lower(
    sched: Schedule, *, reduce_grad: bool = True, parity: bool = True, repair: bool = True
) -> Schedule:
    """Compute-only -> the lowered schedule the runtime executes (see module docstring)."""
    low = add_comms(sched)
    if parity:
        low = apply_parity_rule(low)
    if repair:
        low = repair_deadlocks(low)
    if reduce_grad:
        low = add_wait_reduce(add_reduce_grad(low))
    validate_lowered(low)
    return low
