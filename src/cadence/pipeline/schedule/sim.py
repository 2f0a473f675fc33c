"""Discrete-event simulator over a global lowered schedule, and the runtime's gate.

`simulate` runs a lowered schedule under switchable semantics; `verify` (IR
validation + strict simulation) is what the runtime runs before it creates any
process group; `repair_deadlocks` is the one lowering pass that needs the
simulator, so it lives here and the passes import it (passes -> sim, one way).

[Note: simulator semantics]
- Each rank runs its actions in program order. RECV *posts* a receive and never
  blocks; a compute blocks until its RECVs have completed (or its LOCAL ran).
- SEND is issued when reached (like ``isend``) and does not block by itself.
  Under ``send="rendezvous"`` (default, strict: gloo really blocks, and it is
  NCCL's worst case) it *completes* only when the matching RECV is posted (and,
  with serialisation, reached); ``WAIT_SEND`` and the end of the step block
  until completion. A blocking send is SEND + WAIT_SEND; ``BARRIER`` waits for
  every send its rank issued so far. ``send="eager"`` with
  ``eager=k`` completes up to k unmatched sends per rank at once (buffered).
- Matching: on each channel (src_rank, dst_rank) the i-th SEND meets the i-th
  RECV; their (src stage, dst stage, payload, slot, mb) must agree, else a
  `FifoMismatchError` ("FIFO mismatch on channel (0->1), seq 0: expected 1F1 got
  1F0").
- ``serialize=True`` models NCCL communicators: ops of one rank on one group
  progress in issue order, so an op that cannot progress blocks later ops on that
  group. Groups per ``mode``: ``shared`` (one), ``per_direction`` (activations /
  gradients), ``per_directed_edge`` (one per channel: no cross-edge coupling).
  With looped placements this reproduces the hang of pytorch/pytorch#195760: a
  receive on the wrap-around edge (rank p-1 -> 0) queued behind unrelated sends to
  rank 1 on the same communicator closes a cross-rank wait cycle. Skew
  (``TimeModel.start_delay``) moves times only: in this model the cycle is a
  property of the issue orders, which is exactly why it is a latent hang that skew
  exposes on real hardware.
- A deadlock raises `ScheduleDeadlockError` with the wait-for cycle
  (rank -[action, channel, seq]-> rank) and the first blocked action per rank.
- Bubble fraction (``bubble``) = idle / (p x makespan), start/end stagger
  included; ``bubble_in_span`` = idle inside each rank's first-start..last-end.
- Memory (`MemoryModel`): a rank holds its live chunk activations (an F adds one,
  a B or W frees one) plus the parameters of its resident stages. A stage whose
  schedule has an UNSHARD is resident from its UNSHARD to its RESHARD, and a
  compute of it outside that window is refused; a stage without one (replicated,
  or gathered on demand by its wrapper) counts as always resident.
  ``peak_memory`` is the per-rank peak of the sum, ``peak_reductions`` the most
  REDUCE_GRADs a rank had issued and not yet waited for.
"""

from __future__ import annotations

import math
from heapq import heappop, heappush
from typing import Any, Literal, cast

from cadence.pipeline.schedule._errors import (
    FifoMismatchError,
    ScheduleDeadlockError,
    ScheduleValidationError,
)
from cadence.pipeline.schedule.ir import Action, ActionKind, Payload, Schedule
from cadence.pipeline.schedule.sim_model import MemoryModel, SimResult, TimeModel, _Op
from cadence.pipeline.schedule.validate import Edge, inputs_of, outputs_of, validate_lowered

__all__ = [
    "ChannelMode",
    "FifoMismatchError",
    "MemoryModel",
    "ScheduleDeadlockError",
    "SimResult",
    "TimeModel",
    "repair_deadlocks",
    "simulate",
    "verify",
]

ChannelMode = Literal["shared", "per_direction", "per_directed_edge"]
_MODES = ("shared", "per_direction", "per_directed_edge")


def _label(src: int, dst: int, payload: Payload, mb: int) -> str:
    return f"{dst}{'F' if payload is Payload.ACT else 'B'}{mb}"


class _Sim:
    def __init__(
        self,
        sched: Schedule,
        mode: str,
        send: str,
        eager: int,
        serialize: bool,
        time: TimeModel,
        memory: MemoryModel | None = None,
    ) -> None:
        if mode not in _MODES:
            raise ScheduleValidationError(f"mode must be one of {_MODES}, got {mode!r}")
        if send not in ("rendezvous", "eager"):
            raise ScheduleValidationError(f"send must be 'rendezvous' or 'eager', got {send!r}")
        self.s, self.mode, self.send, self.eager, self.serialize, self.tm = (
            sched,
            mode,
            send,
            eager,
            serialize,
            time,
        )
        self.p, self.n = sched.num_ranks, sched.num_stages
        self.v = max(1, self.n // self.p)
        self.pc = [0] * self.p
        self.t = [time.start_delay[r] if r < len(time.start_delay) else 0.0 for r in range(self.p)]
        self.sends: dict[tuple[int, int], list[_Op]] = {}
        self.recvs: dict[tuple[int, int], list[_Op]] = {}
        self.queues: dict[tuple[int, Any], list[_Op]] = {}
        self.heads: dict[tuple[int, Any], tuple[int, float]] = {}
        self.matched: dict[tuple[int, int], int] = {}
        self.avail: dict[tuple[int, Edge], float] = {}  # (rank, input key) -> time available
        self.recv_of: dict[tuple[int, Edge], _Op] = {}
        self.produced: dict[Edge, float] = {}
        self.sent_by: dict[tuple[Edge, int], _Op] = {}
        self.busy = [0.0] * self.p
        self.first = [math.inf] * self.p
        self.last = [0.0] * self.p
        self.live = [0] * self.p
        self.peak = [0] * self.p
        self.events: list[tuple[int, str, float, float]] = []
        self.flows: list[tuple[int, int, float, float, str]] = []
        self.mem = memory or MemoryModel()
        gathered = {a.stage for acts in sched.ranks for a in acts if a.kind is ActionKind.UNSHARD}
        # Stages without an UNSHARD are resident throughout; the others from UNSHARD on.
        self.resident: list[set[int]] = [set(sched.stages_of(r)) - gathered for r in range(self.p)]
        self.peak_mem = [0.0] * self.p
        self.reducing = [0] * self.p
        self.peak_red = [0] * self.p
        # See [Note: matching only what changed].
        self.rank_sends: list[list[_Op]] = [[] for _ in range(self.p)]
        self.buffered = [0] * self.p  # eager sends completed but not yet matched
        self.chan_index: dict[tuple[int, int], int] = {}  # in ``self.sends`` order
        self.chan_list: list[tuple[int, int]] = []
        self.dirty: set[int] = set()  # channels the next `_match` visits
        self.pass_heap: list[int] = []  # channels still to visit in this `_match`
        self.cursor: int | None = None  # the channel `_match` is on, None outside it
        self.scan_all = serialize and send == "eager"
        self.unit_cost: dict[ActionKind, float] | None = None
        if type(time).duration is TimeModel.duration:
            b = time.b if time.b is not None else time.i + time.w
            self.unit_cost = {
                ActionKind.F: time.f,
                ActionKind.I: time.i,
                ActionKind.W: time.w,
                ActionKind.B: b,
            }

    def _group(self, a: Action, ch: tuple[int, int]) -> Any:
        if self.mode == "shared":
            return "all"
        if self.mode == "per_direction":
            return a.payload
        return ch

    def _key(self, a: Action) -> Edge:
        peer = a.peer_stage
        src, dst = (peer, a.stage) if a.kind is ActionKind.RECV else (a.stage, peer)
        # Only transfers come here, and Action.__post_init__ sets a transfer's peer,
        # payload and microbatch; they are Optional on Action for the other kinds.
        return cast(Edge, (src, dst, a.payload, a.mb))

    # -- matching ---------------------------------------------------------------

    def _head_ok(self, op: _Op) -> float | None:
        """None while an earlier op on the same communicator is unfinished, else the
        time the communicator is free for ``op`` (serialisation model)."""
        if not self.serialize:
            return 0.0
        # Ops of a serialised queue complete in issue order, so a cursor past the
        # finished prefix (and the latest finish in it) answers in amortised O(1).
        q = (op.rank, op.group)
        queue, (head, free) = self.queues[q], self.heads.get(q, (0, 0.0))
        while head < len(queue) and queue[head] is not op:
            done = queue[head].done
            if done is None:
                break
            free = max(free, done)
            head += 1
        self.heads[q] = (head, free)
        return free if head < len(queue) and queue[head] is op else None

    def _match(self) -> bool:
        """Match every pair that can be matched, channel by channel in first-SEND order.

        [Note: matching only what changed]
        A channel's next pair can become matchable only when one of its ops is
        posted or, with serialisation, when an op ahead of one of them on its
        communicator completes. So instead of scanning every channel after every
        step (O(channels) per action, which made the proof of a p-rank schedule
        grow as p times its actions), the simulator marks the channels such an
        event touches and visits only those, in the same channel order as a full
        scan and within the same call whenever the full scan would have reached
        them in that call (a mark on a channel further along is visited now, one
        on a channel already passed waits for the next call). Every pair is
        therefore matched at the same point of the run, with the same times, the
        same flows in the same order and the same first error. Eager sends under
        serialisation keep the full scan: there the queue cursor that
        `_head_ok` advances may step past a buffered, still unmatched send, so
        the moment each channel is looked at is part of the outcome.
        """
        progress = False
        if self.scan_all:
            self.pass_heap = list(range(len(self.chan_list)))
        else:
            self.pass_heap = sorted(self.dirty)
            self.dirty = set()
        heap = self.pass_heap
        last = -1
        while heap:
            idx = heappop(heap)
            if idx == last:
                continue
            last = self.cursor = idx
            progress |= self._match_channel(self.chan_list[idx])
        self.cursor = None
        return progress

    def _mark(self, ch: tuple[int, int]) -> None:
        """Have `_match` look at ``ch`` again; see [Note: matching only what changed]."""
        idx = self.chan_index.get(ch)
        if idx is None:  # no SEND on it yet: nothing to match
            return
        if self.cursor is not None and idx > self.cursor:
            heappush(self.pass_heap, idx)
        else:
            self.dirty.add(idx)

    def _mark_behind(self, op: _Op) -> None:
        """With serialisation, an op that completes may put the next op of its
        communicator at the head of the queue."""
        queue = self.queues[(op.rank, op.group)]
        if op.qpos + 1 < len(queue):
            self._mark(queue[op.qpos + 1].channel)

    def _match_channel(self, ch: tuple[int, int]) -> bool:
        progress = False
        sends = self.sends[ch]
        recvs = self.recvs.get(ch, [])
        i = self.matched.get(ch, 0)
        while i < len(sends) and i < len(recvs):
            s, r = sends[i], recvs[i]
            hs, hr = self._head_ok(s), self._head_ok(r)
            if hs is None or hr is None:
                break
            ks, kr = self._key(s.action), self._key(r.action)
            if (ks, s.action.slot) != (kr, r.action.slot):
                raise FifoMismatchError(
                    f"FIFO mismatch on channel ({ch[0]}->{ch[1]}), seq {i}: expected "
                    f"{_label(*kr)} got {_label(*ks)} (rank {ch[1]} posted its receives in "
                    f"a different order than rank {ch[0]} sent; post RECVs in send order)"
                )
            for op in (s, r):
                if op.action.seq is not None and op.action.seq != i:
                    raise FifoMismatchError(
                        f"rank {op.rank}, action {op.index} ({op.action}): sequence number "
                        f"{op.action.seq} but it is op {i} on channel ({ch[0]}->{ch[1]}); "
                        "re-run lowering instead of editing seq by hand"
                    )
            t = max(s.post, r.post, hs, hr)
            done = t + self.tm.comm()
            s.match = r.match = t
            if s.done is None:
                s.done = t
            else:  # an eager send completed when it was buffered
                self.buffered[s.rank] -= 1
            r.done = done
            if self.serialize and not self.scan_all:
                self._mark_behind(s)
                self._mark_behind(r)
            self.flows.append((ch[0], ch[1], t, done, str(s.action)))
            i += 1
            progress = True
        self.matched[ch] = i
        return progress

    # -- stepping ---------------------------------------------------------------

    def _post(self, r: int, i: int, a: Action, table: dict[tuple[int, int], list[_Op]]) -> _Op:
        key = self._key(a)
        src_rank, dst_rank = self.s.placement[key[0]], self.s.placement[key[1]]
        ch = (src_rank, dst_rank)
        op = _Op(r, i, a, ch, self._group(a, ch), self.t[r])
        op.pos = len(table.setdefault(ch, []))
        table[ch].append(op)
        if table is self.sends and ch not in self.chan_index:
            self.chan_index[ch] = len(self.chan_list)
            self.chan_list.append(ch)
        queue = self.queues.setdefault((r, op.group), [])
        op.qpos = len(queue)
        queue.append(op)
        self._mark(ch)
        return op

    def _step(self, r: int) -> bool:
        acts = self.s.ranks[r]
        if self.pc[r] >= len(acts):
            return False
        i, a = self.pc[r], acts[self.pc[r]]
        if a.kind is ActionKind.SEND:
            op = self._post(r, i, a, self.sends)
            self.sent_by[(self._key(a), a.slot)] = op
            self.rank_sends[r].append(op)
            if self.send == "eager" and self.buffered[r] < self.eager:
                op.done = op.post
                self.buffered[r] += 1
            self.pc[r] += 1
            return True
        if a.kind is ActionKind.RECV:
            op = self._post(r, i, a, self.recvs)
            self.recv_of[(r, self._key(a))] = op
            self.pc[r] += 1
            return True
        if a.kind is ActionKind.LOCAL:
            self.avail[(r, self._key(a))] = self.produced.get(self._key(a), self.t[r])
            self.pc[r] += 1
            return True
        if a.kind is ActionKind.WAIT_SEND:
            sent_op = self.sent_by.get((self._key(a), a.slot))
            if sent_op is None or sent_op.done is None:
                return False
            self.t[r] = max(self.t[r], sent_op.done)
            self.pc[r] += 1
            return True
        if a.kind is ActionKind.BARRIER:
            sent = self.rank_sends[r]  # any order: only "all done" and the latest matter
            if any(o.done is None for o in sent):
                return False
            self.t[r] = max([self.t[r], *(o.done for o in sent if o.done is not None)])
            self.pc[r] += 1
            return True
        if a.is_compute:
            for c in a.compute_parts():
                if c.stage not in self.resident[r]:
                    raise ScheduleValidationError(
                        f"rank {r}, action {i} ({c}): stage {c.stage}'s parameters are not "
                        "gathered here (no UNSHARD before it, or RESHARD already ran)"
                    )
            start = self.t[r]
            for key in inputs_of(a, self.n):
                if (r, key) in self.avail:
                    start = max(start, self.avail[(r, key)])
                    continue
                recv_op = self.recv_of.get((r, key))
                if recv_op is None or recv_op.done is None:
                    return False
                start = max(start, recv_op.done)
            dur = self._duration(a)
            end = start + dur
            self.t[r] = end
            self.busy[r] += dur
            self.first[r] = min(self.first[r], start)
            self.last[r] = max(self.last[r], end)
            for c in a.compute_parts():
                if c.kind is ActionKind.F:
                    self.live[r] += 1
                    self.peak[r] = max(self.peak[r], self.live[r])
                elif c.kind in (ActionKind.B, ActionKind.W):
                    self.live[r] -= 1
            for key in outputs_of(a, self.n):
                self.produced[key] = end
            self.events.append((r, str(a), start, end))
            self._account(r)
            self.pc[r] += 1
            return True
        # REDUCE_GRAD, WAIT_REDUCE_GRAD, UNSHARD, RESHARD: zero-time markers for time.
        if a.kind is ActionKind.UNSHARD:
            self.resident[r].add(a.stage)
        elif a.kind is ActionKind.RESHARD:
            self.resident[r].discard(a.stage)
        elif a.kind is ActionKind.REDUCE_GRAD:
            self.reducing[r] += 1
            self.peak_red[r] = max(self.peak_red[r], self.reducing[r])
        elif a.kind is ActionKind.WAIT_REDUCE_GRAD:
            self.reducing[r] -= 1
        self._account(r)
        self.pc[r] += 1
        return True

    def _duration(self, a: Action) -> float:
        cost = self.unit_cost
        if cost is None:  # a TimeModel subclass with its own durations
            return self.tm.duration(a, self.v)
        # TimeModel.duration without rebuilding its table per action; same sum, same float.
        total = sum(cost[c.kind] for c in a.compute_parts())
        return total / self.v if self.tm.scale_by_chunks else total

    def _account(self, r: int) -> None:
        mem = self.live[r] * self.mem.activation + len(self.resident[r]) * self.mem.parameters
        self.peak_mem[r] = max(self.peak_mem[r], mem)

    def _rank_sends(self, r: int) -> list[_Op]:
        """Rank r's sends in channel order, then post order (the order reports name them)."""
        return sorted(self.rank_sends[r], key=lambda o: (self.chan_index[o.channel], o.pos))

    def run(self) -> None:
        while True:
            progress = self._match()
            for r in range(self.p):
                while self._step(r):
                    progress = True
                    self._match()
            if not progress:
                break
        unfinished = [r for r in range(self.p) if self.pc[r] < len(self.s.ranks[r])]
        open_sends = [o for ops in self.sends.values() for o in ops if o.done is None]
        if unfinished or open_sends:
            self._deadlock(unfinished, open_sends)

    # -- deadlock report ----------------------------------------------------------

    def blocked_info(self) -> dict[int, tuple[int, Action, _Op | None, int | None, str]]:
        """rank -> (index, action, op it waits on, rank it waits on, reason)."""
        info: dict[int, tuple[int, Action, _Op | None, int | None, str]] = {}
        for r in range(self.p):
            acts = self.s.ranks[r]
            op: _Op | None = None
            if self.pc[r] < len(acts):
                i, a = self.pc[r], acts[self.pc[r]]
                if a.is_compute:
                    for key in inputs_of(a, self.n):
                        cand = self.recv_of.get((r, key))
                        if (r, key) not in self.avail and cand is not None and cand.done is None:
                            op = cand
                            break
                elif a.kind is ActionKind.WAIT_SEND:
                    op = self.sent_by.get((self._key(a), a.slot))
                elif a.kind is ActionKind.BARRIER:
                    op = next((o for o in self._rank_sends(r) if o.done is None), None)
            else:
                left = [o for o in self._rank_sends(r) if o.done is None]
                if not left:
                    continue
                op, i = left[0], len(acts)
                a = op.action  # the end of the step waits for every send
            if op is None:
                info[r] = (i, a, None, None, "waiting for an input that was never received")
                continue
            blocker = op
            if self.serialize:
                for o in self.queues[(op.rank, op.group)]:
                    if o is op:
                        break
                    if o.done is None:
                        blocker = o
                        break
            peer = blocker.channel[1] if blocker.channel[0] == r else blocker.channel[0]
            what = "RECV" if blocker in self.recvs.get(blocker.channel, []) else "SEND"
            reason = (
                f"waiting on {blocker.action} ({what} on channel ({blocker.channel[0]}->"
                f"{blocker.channel[1]}), seq {blocker.pos}) for rank {peer}"
            )
            if blocker is not op:
                reason += f", queued behind it on communicator {blocker.group!r}"
            info[r] = (i, a, blocker, peer, reason)
        return info

    def _deadlock(self, unfinished: list[int], open_sends: list[_Op]) -> None:
        info = self.blocked_info()
        cycle: list[tuple[int, str, tuple[int, int], int, int | None]] = []
        for start in sorted(info):
            path: list[int] = []
            r: int | None = start
            while r is not None and r in info and r not in path:
                path.append(r)
                r = info[r][3]
            if r is not None and r in path:
                loop = path[path.index(r) :]
                for x in loop:
                    i, a, op, peer, _ = info[x]
                    # Each rank of the cycle waits on a peer, and blocked_info names a
                    # peer only together with the op it waits on.
                    assert op is not None
                    cycle.append((x, str(a), op.channel, op.pos, peer))
                break
        lines = [
            "schedule deadlocks ("
            + f"send={self.send}, mode={self.mode}, serialize={self.serialize})"
        ]
        if cycle:
            parts = [
                f"rank {x} -[{a}, channel {ch[0]}->{ch[1]}, seq {sq}]->"
                for x, a, ch, sq, _ in cycle
            ]
            lines.append("wait-for cycle: " + " ".join(parts) + f" rank {cycle[0][0]}")
        lines.append("first blocked action per rank:")
        for r in sorted(info):
            i, a, _, _, reason = info[r]
            lines.append(f"  rank {r}: action {i} {a}: {reason}")
        raise ScheduleDeadlockError(
            "\n".join(lines), cycle, {r: (v[0], str(v[1]), v[4]) for r, v in info.items()}
        )

    def result(self) -> SimResult:
        makespan = max(self.last) if self.p else 0.0
        span = tuple(
            (lt - ft) if ft != math.inf else 0.0
            for ft, lt in zip(self.first, self.last, strict=True)
        )
        total = sum(self.busy)
        bubble = 1 - total / (self.p * makespan) if makespan else 0.0
        in_span = 1 - total / sum(span) if sum(span) else 0.0
        return SimResult(
            makespan=makespan,
            busy=tuple(self.busy),
            span=span,
            bubble=bubble,
            bubble_in_span=in_span,
            peak_inflight=tuple(self.peak),
            mode=self.mode,
            send=self.send if self.send == "rendezvous" else f"eager({self.eager})",
            events=tuple(self.events),
            flows=tuple(self.flows),
            peak_memory=tuple(self.peak_mem),
            peak_reductions=tuple(self.peak_red),
        )


def simulate(
    sched: Schedule,
    *,
    mode: ChannelMode = "per_directed_edge",
    send: Literal["rendezvous", "eager"] = "rendezvous",
    eager: int = 1,
    serialize: bool = False,
    time: TimeModel | None = None,
    memory: MemoryModel | None = None,
) -> SimResult:
    """Simulate a lowered schedule; raise on deadlock or FIFO mismatch."""
    sim = _Sim(sched, mode, send, eager, serialize, time or TimeModel(), memory)
    sim.run()
    return sim.result()


def verify(
    sched: Schedule,
    *,
    mode: ChannelMode = "per_directed_edge",
    serialize: bool = True,
    time: TimeModel | None = None,
) -> SimResult:
    """The runtime's gate: IR validation + strict simulation (rendezvous sends,
    communicator serialisation in ``mode``). Raises `ScheduleValidationError`,
    `FifoMismatchError` or `ScheduleDeadlockError`; returns the `SimResult`."""
    if not sched.meta.lowered:
        raise ScheduleValidationError("verify takes a lowered schedule; run lower(schedule) first")
    validate_lowered(sched)
    return simulate(sched, mode=mode, send="rendezvous", serialize=serialize, time=time)


def repair_deadlocks(sched: Schedule, *, max_moves: int | None = None) -> Schedule:
    """Hoist the receives that blocked rendezvous sends wait for.

    Runs the structural simulator (rendezvous sends, no serialisation); while some
    SEND waits for a RECV its peer has not posted yet, that RECV moves up to the
    peer's blocked point. A RECV never blocks (it only posts), so each move lets
    the blocked send complete and the simulation progress; the number of moves is
    bounded by the number of actions. Only schedules with explicit blocking sends
    (WAIT_SEND) need it: cadence's own lowering never emits one.
    """
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


def _structural_blocked_send(sched: Schedule) -> tuple[int, int, int] | None:
    """For `repair_deadlocks`: (peer, peer's pc, index of the RECV to hoist), or None."""
    sim = _Sim(sched, "per_directed_edge", "rendezvous", 0, False, TimeModel())
    try:
        sim.run()
    except ScheduleDeadlockError:
        for _r, (_, _, op, peer, _) in sorted(sim.blocked_info().items()):
            if op is None or peer is None or op.match is not None or op.channel[0] != op.rank:
                continue
            acts = sched.ranks[peer]
            for j in range(sim.pc[peer], len(acts)):
                b = acts[j]
                if b.kind is ActionKind.RECV and sim._key(b) == sim._key(op.action):
                    return peer, sim.pc[peer], j
        return None
    return None
