"""Collectives built from pairwise point-to-point exchanges, for gloo.

[Note: why cadence replaces some of gloo's collectives]
On CPU, gloo's ``reduce_scatter`` costs about as much as an ``all_reduce`` of the
whole input (it reduces every element, not only the caller's shard), and its
``all_gather`` copies through staging buffers. Both are on fully_shard's critical
path. Measured with ``cadence bench collectives`` (the record `CROSSOVER_RECORD`
names; world 2, 4 and 8, one thread per rank, 64 KiB to 16 MiB, median time
exchange / gloo's own): an exchange in which every rank sends each peer the peer's
chunk and sums what it receives takes 0.37-0.59 of gloo's reduce-scatter from 1 MiB
at every world, and 0.44 from 64 KiB on 4 and 8 ranks; an exchange all-gather
0.59-0.93 from 64 KiB on 4 and 8 ranks but only from 4 MiB on 2 (1.00 at 1 MiB,
1.35 at 256 KiB). An all-reduce by exchange (a reduce-scatter exchange, then a
gather) ends 1.04-1.13 of gloo's own at 16 MiB on every world, so "auto" never picks
it; it is opt-in. See [Note: auto picks by measured crossovers] for the rule.

The exchange is the same arithmetic, in a fixed order: a reduce-scatter's shard is
summed in rank order, ``((x_0 + x_1) + x_2) + ...``, on the one rank that owns it,
so every run is deterministic; at world 2 this is bit-for-bit gloo's result
(floating-point addition of two values commutes). Works are posted with a private
tag so they never match a user's ``send``/``recv`` on the same group, and all ranks
post them in program order, as collectives require anyway: gloo matches
point-to-point messages first-in first-out per peer and tag.

Threads: gloo copies a send into the socket on the thread that posts it, its
point-to-point works say they are complete only once waited, and a reduce-scatter's
sum needs a thread. So each group has two threads (`_GroupThreads`), where gloo's
worker threads stand for its own collectives: one posts exchanges in issue order,
one waits them and sums; ``is_completed()`` turns True by itself, with the result in
place, and the caller's thread only queues the exchange.

Only CPU tensors on a gloo group take this path; NCCL's collectives are already
the right algorithm and are never replaced.

[Note: bounded messages in flight]
An exchange pairs ranks in rounds: in round ``r`` (1 .. world-1) a rank sends to
``rank + r`` and receives from ``rank - r`` (mod world), so both ends of every pair
meet in the same round. Rounds are posted `PEERS_IN_FLIGHT` at a time, the next
window once the previous one completed, so a rank has at most ``2 * PEERS_IN_FLIGHT``
messages (and socket buffers) outstanding per exchange at any world size, where
posting every peer at once would hold ``2 * (world - 1)``. The first window is posted
by the group's poster thread in issue order, later windows by its finisher thread in
issue order; a pair's messages always fall in the same window on both ends, so
first-in first-out matching per peer and tag still holds. No window waits on a
message its peer posts later than its own, so windows cannot deadlock.

[Note: auto picks by measured crossovers]
``"auto"`` looks up `AUTO_CROSSOVER_BYTES`: for each collective and each measured
world, the smallest message (bytes of the whole, unsharded tensor) from which the
exchange measured faster than gloo's own (median ratio under
``cadence.bench.collectives.CROSSOVER_RATIO``, 0.95) at that size and every larger
measured size, in the ``cadence bench collectives`` record `CROSSOVER_RECORD`;
``tests/foundation/test_exchange.py`` re-derives the table from that record. A world
between two measured worlds uses the next larger measured world's row, where each
rank has more peers, so the choice errs toward what held with more messages. Above
the largest measured world nothing was measured, and gloo's own algorithm is used.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from cadence.errors import CadenceTypeError, CadenceValueError

__all__ = [
    "CollectiveAlgorithms",
    "ExchangeWork",
    "check_algorithms",
    "exchange_all_gather",
    "exchange_all_reduce",
    "exchange_reduce_scatter",
]

Algorithm = Literal["auto", "native", "exchange"]
_CHOICES = ("auto", "native", "exchange")

# gloo's send/recv slot for cadence's exchanges ("cdnc"); users' point-to-point ops use
# other tags (0 by default), so the two never match each other.
EXCHANGE_TAG = 0x63646E63
GATHER_TAG = EXCHANGE_TAG + 1  # an all-reduce's second phase, posted by the finisher
# Rounds of an exchange posted at once: see [Note: bounded messages in flight].
PEERS_IN_FLIGHT = 4
# See [Note: auto picks by measured crossovers]. None: gloo's own at every measured size.
CROSSOVER_RECORD = "docs/records/collectives-20261203T211359Z.json"
AUTO_CROSSOVER_BYTES: dict[str, dict[int, int | None]] = {
    "all_gather": {2: 1 << 22, 4: 1 << 16, 8: 1 << 16},
    "all_reduce": {2: None, 4: None, 8: None},
    "reduce_scatter": {2: 1 << 18, 4: 1 << 16, 8: 1 << 16},
}
MEASURED_WORLDS = (2, 4, 8)


def _auto_threshold(kind: str, world: int) -> int | None:
    """The smallest message ``"auto"`` exchanges; None: never (or beyond what was measured)."""
    row = next((w for w in MEASURED_WORLDS if w >= world), None)
    return None if row is None else AUTO_CROSSOVER_BYTES[kind][row]


def auto_uses_exchange(kind: str, nbytes: int, world: int) -> bool:
    """``"auto"``'s choice for a ``nbytes`` collective of ``kind`` on ``world`` ranks."""
    threshold = _auto_threshold(kind, world)
    return threshold is not None and nbytes >= threshold


@dataclass(frozen=True)
class CollectiveAlgorithms:
    """How `cadence.Comm` runs each collective on a gloo group (NCCL is always native).

    ``"auto"`` (default) picks what measured faster on CPU for the message's size and
    the world (`AUTO_CROSSOVER_BYTES`), and gloo's own above the largest measured
    world. ``"native"`` always calls gloo's collective; ``"exchange"`` always uses
    pairwise exchanges, at most `PEERS_IN_FLIGHT` peers at a time. See
    [Note: why cadence replaces some of gloo's collectives] and
    [Note: auto picks by measured crossovers] in ``cadence/_groups/exchange.py``.
    """

    reduce_scatter: Algorithm = "auto"
    all_gather: Algorithm = "auto"
    all_reduce: Algorithm = "auto"

    def __post_init__(self) -> None:
        for name in ("reduce_scatter", "all_gather", "all_reduce"):
            value = getattr(self, name)
            if value not in _CHOICES:
                raise CadenceValueError(
                    f"CollectiveAlgorithms.{name}={value!r}; use one of {', '.join(_CHOICES)}"
                )

    @classmethod
    def native(cls) -> CollectiveAlgorithms:
        """gloo's own collectives everywhere (what torch's DDP and FSDP2 use)."""
        return cls("native", "native", "native")

    def uses_exchange(self, kind: str, backend: str, tensor: torch.Tensor, world: int) -> bool:
        """Whether collective ``kind`` on ``tensor`` goes through an exchange."""
        # The cheap tests first: this runs at every collective's issue, on the critical
        # path of a bucket's launch, and "auto" never exchanges an all-reduce.
        choice: Algorithm = getattr(self, kind)
        if world < 2 or backend != "gloo" or choice == "native":
            return False
        threshold = _auto_threshold(kind, world) if choice == "auto" else 0
        if threshold is None:
            return False
        if tensor.device.type != "cpu":
            return False
        if tensor.layout != torch.strided:  # a sparse gradient: gloo's own sparse all-reduce
            return False
        return tensor.numel() * tensor.element_size() >= threshold


def check_algorithms(value: object, who: str) -> CollectiveAlgorithms:
    """The wrappers' setters take only a `CollectiveAlgorithms` (a string is a typo away)."""
    if not isinstance(value, CollectiveAlgorithms):
        raise CadenceTypeError(
            f"{who}.set_collective_algorithms takes a cadence.CollectiveAlgorithms, got "
            f"{type(value).__name__}; e.g. CollectiveAlgorithms.native()"
        )
    return value


class ScratchPool:
    """Receive buffers kept between exchanges of the same shape.

    A data-parallel step all-reduces the same buckets every step; a fresh multi-MiB
    receive buffer per collective costs the allocator's page faults each time, which
    is CPU on the same cores the exchange was meant to save.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        with self._lock:
            free = self._free.get((shape, dtype, device))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        # Called on the finisher thread while the caller's thread may be taking.
        with self._lock:
            self._free.setdefault((tuple(t.shape), t.dtype, t.device), []).append(t)


class _GroupThreads:
    """Two daemon threads per process group that run its exchanges, in issue order.

    The poster posts each exchange's sends and receives: gloo copies a send into the
    socket on the posting thread, which on the caller's thread would be compute time
    (gloo's own collectives do it on gloo's worker threads). The finisher then waits
    each exchange's messages and runs its sum, because gloo's point-to-point works
    report completion only once waited: so ``is_completed()`` turns True by itself,
    with the result in place. Both release the GIL while gloo or torch work.

    FIFO keeps every rank's messages in the same order per peer and tag, since all
    ranks issue a group's collectives in the same order; one pair of threads per group,
    as gloo has worker threads per group, so groups never wait on each other.
    """

    def __init__(self, name: str) -> None:
        self._to_post: queue.SimpleQueue[ExchangeWork] = queue.SimpleQueue()
        self._to_finish: queue.SimpleQueue[ExchangeWork] = queue.SimpleQueue()
        for target, suffix in ((self._post_loop, "post"), (self._finish_loop, "finish")):
            threading.Thread(target=target, name=f"{name}-{suffix}", daemon=True).start()

    def submit(self, work: ExchangeWork) -> None:
        self._to_post.put(work)

    def _post_loop(self) -> None:
        while True:
            work = self._to_post.get()
            work._post_messages()
            self._to_finish.put(work)

    def _finish_loop(self) -> None:
        while True:
            self._to_finish.get()._complete()


_THREADS: dict[int, _GroupThreads] = {}
_THREADS_LOCK = threading.Lock()


def _forget_threads_after_fork() -> None:
    # A forked child has none of the parent's threads: queueing to their queues would
    # wait forever, so the child starts its own.
    global _THREADS_LOCK
    _THREADS.clear()
    _THREADS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_threads_after_fork)


def _group_threads(pg: Any) -> _GroupThreads:
    # Keyed by the group object's id: a group created later at a reused address gets
    # the same threads, which hold no state of the old group between works.
    with _THREADS_LOCK:
        threads = _THREADS.get(id(pg))
        if threads is None:
            threads = _THREADS[id(pg)] = _GroupThreads(f"cadence-exchange-{len(_THREADS)}")
        return threads


Step = Callable[[], Sequence[Any]]


class ExchangeWork:
    """One collective made of point-to-point messages, posted in steps.

    Each step posts messages and returns their works; the next step runs once they
    completed. The first step runs on the group's poster thread, the rest on its
    finisher thread (`_GroupThreads`), so windows of rounds, a sum and an all-reduce's
    gather phase all run off the caller's thread; an error there (a timeout, a failed
    sum) is re-raised by ``wait()``. Without a group (tests) all steps run at
    construction.
    """

    __slots__ = ("_done", "_error", "_steps", "_works")

    def __init__(self, steps: Sequence[Step], pg: Any = None) -> None:
        self._steps: list[Step] = list(steps)
        self._works: list[Any] = []
        self._error: BaseException | None = None
        self._done = threading.Event()
        if pg is None:
            self._post_messages()
            self._complete()
        else:
            _group_threads(pg).submit(self)

    def _run_step(self) -> None:
        self._works = list(self._steps.pop(0)())

    def _post_messages(self) -> None:
        try:
            self._run_step()
        except BaseException as e:  # re-raised on the caller's thread by wait()
            self._error = e
            self._steps = []

    def _complete(self) -> None:
        try:
            if self._error is not None:
                return
            while True:
                for work in self._works:
                    work.wait()
                if not self._steps:
                    break
                self._run_step()
        except BaseException as e:  # re-raised on the caller's thread by wait()
            self._error = e
        finally:
            self._works = []
            self._steps = []
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


def _post(
    pg: dist.ProcessGroup,
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    tag: int = EXCHANGE_TAG,
) -> list[Any]:
    # ProcessGroup.send/recv take group ranks; calling them directly skips the Python
    # wrappers of dist.isend/irecv, which cost more than the exchange saves on tiny tensors.
    works = [pg.send([t], peer, tag) for t, peer in sends]
    works += [pg.recv([t], peer, tag) for t, peer in recvs]
    return works


def _windows(
    pg: dist.ProcessGroup,
    rank: int,
    world: int,
    send: Callable[[int], torch.Tensor],
    recv: Callable[[int], torch.Tensor],
    tag: int = EXCHANGE_TAG,
) -> list[Step]:
    """One step per window of rounds; see [Note: bounded messages in flight].

    In round ``r`` this rank sends ``send(rank + r)`` and receives into
    ``recv(rank - r)``, so every peer is sent to and received from exactly once.
    """
    rounds = [((rank + r) % world, (rank - r) % world) for r in range(1, world)]

    def step(window: list[tuple[int, int]]) -> Step:
        sends = [(send(to), to) for to, _ in window]
        recvs = [(recv(frm), frm) for _, frm in window]
        return lambda: _post(pg, sends, recvs, tag)

    return [step(rounds[i : i + PEERS_IN_FLIGHT]) for i in range(0, len(rounds), PEERS_IN_FLIGHT)]


def exchange_all_gather(
    pg: dist.ProcessGroup, output: torch.Tensor, input: torch.Tensor, rank: int, world: int
) -> ExchangeWork:
    """``output = cat(input of every rank)``: send ours to every peer, receive theirs in place."""
    chunks = output.view(world, -1)
    flat = input.reshape(-1)
    steps = _windows(pg, rank, world, lambda _: flat, chunks.__getitem__)

    def own() -> Sequence[Any]:
        chunks[rank].copy_(flat)  # our own part, off the caller's thread too
        return []

    return ExchangeWork([*steps, own], pg)


def exchange_reduce_scatter(
    pg: dist.ProcessGroup, output: torch.Tensor, input: torch.Tensor, rank: int, world: int
) -> ExchangeWork:
    """``output = sum over ranks of their input chunk ``rank```` (SUM; AVG divides after).

    The lowest-ranked peer's chunk is received straight into ``output`` (at world 2
    the exchange then needs no buffer of its own); the others into one buffer. The sum
    runs in rank order: ``output`` holds one of the two lowest ranks' chunks and the
    first addition commutes, so every rank computes ``((x_0 + x_1) + x_2) + ...``.
    """
    chunks = input.reshape(world, -1)
    own = chunks[rank]
    flat_out = output.view(-1)
    peers = [p for p in range(world) if p != rank]
    # An in-place reduce-scatter (``output`` is our own chunk of ``input``) cannot
    # receive into ``output`` before that chunk is summed: everything goes to the buffer.
    in_place = _overlaps(output, own)
    direct = [] if in_place else peers[:1]
    buffered = peers if in_place else peers[1:]
    received = torch.empty((len(buffered), own.numel()), dtype=input.dtype, device=input.device)
    slot = {p: received[i] for i, p in enumerate(buffered)}
    slot.update({p: flat_out for p in direct})
    steps = _windows(pg, rank, world, chunks.__getitem__, slot.__getitem__)

    def finish() -> Sequence[Any]:
        # Rank order, so the sum is the same whichever rank computes it.
        parts = [own.clone() if in_place and p == rank else slot.get(p, own) for p in range(world)]
        if direct:
            # ``output`` holds parts[0] or parts[1]: add the other one (addition commutes).
            flat_out.add_(parts[1] if parts[0] is flat_out else parts[0])
        else:
            torch.add(parts[0], parts[1], out=flat_out)
        for part in parts[2:]:
            flat_out.add_(part)
        return []

    return ExchangeWork([*steps, finish], pg)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    size = a.element_size()
    # Concrete tensors only (no symbolic shapes here): plain ints.
    a0, b0 = int(a.storage_offset()) * size, int(b.storage_offset()) * size
    return a0 < b0 + int(b.numel()) * size and b0 < a0 + int(a.numel()) * size


def exchange_all_reduce(
    pg: dist.ProcessGroup,
    tensor: torch.Tensor,
    rank: int,
    world: int,
    pool: ScratchPool | None = None,
) -> ExchangeWork:
    """A reduce-scatter exchange, then an all-gather exchange of the reduced chunks.

    The bytes and the additions of a ring (each rank sums only its chunk, in rank
    order, so every rank ends with the same bits). The gather is posted by the group's
    finisher thread once the chunk is summed, on its own tag: all ranks' finishers
    post gathers in issue order, as their posters post the scatters, so both message
    streams match first-in first-out. Chunks may differ by one element.
    """
    chunks = tensor.view(-1).tensor_split(world)
    own = chunks[rank]
    peers = [p for p in range(world) if p != rank]
    shape = (world - 1, own.numel())
    received = (
        pool.take(shape, tensor.dtype, tensor.device)
        if pool is not None
        else torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    )
    slot = {p: received[i] for i, p in enumerate(peers)}
    scatter = _windows(pg, rank, world, chunks.__getitem__, slot.__getitem__)
    # Phase two: our summed chunk to every peer, theirs into the chunks phase one
    # sent (those sends are complete, so the chunks are free to overwrite).
    gather = _windows(pg, rank, world, lambda _: own, chunks.__getitem__, GATHER_TAG)

    def finish() -> Sequence[Any]:
        # Sum into our own chunk, which phase one did not send. It is an addend too:
        # when it is not among the first two (rank >= 2) read it from a copy.
        mine = own.clone() if rank >= 2 else own
        parts = [mine if p == rank else slot[p] for p in range(world)]
        if rank < 2:
            own.add_(parts[1 - rank])  # own + the other of the first two: commutes
        else:
            torch.add(parts[0], parts[1], out=own)
        for part in parts[2:]:
            own.add_(part)
        if pool is not None:
            pool.give(received)
        return gather[0]()

    return ExchangeWork([*scatter, finish, *gather[1:]], pg)
