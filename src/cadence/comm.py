"""The collective adapter: every collective and point-to-point message cadence sends.

The wrappers, the pipeline runtime and the trainer's loop move data only through
`Comm`. The process-group API is still called elsewhere for what `Comm` does not
do (starting the job, creating groups, asking a group for ranks); docs/architecture.md
("Who calls torch.distributed") lists each such module and why.

Why one place for the collectives:
- The collectives the training path issues are all here, under the names every
  supported torch has: ``all_gather_single`` / ``reduce_scatter_single`` (torch 2.13
  deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in their favour).
- Averaging has one implementation; see [Note: AVG is SUM plus a divide].
- Every collective can be recorded in an opt-in `EventLog` (``_groups/event_log.py``: kind,
  bytes, group, issue time, wait start, wait end). Tests and benchmarks read it to
  prove counts, order and overlap, independently of the backend.
- Setup and teardown cost the same per rank at any world: see [Note: agreeing by digest].

[Note: agreeing by digest]
Ranks check that they agree (plans, options, cache keys) with ``agree``: each hashes
its canonical bytes (SHA-256) into 8 words of 32 bits and one all-reduce MAX runs
over the words and their negations, so min == max per word (-max(-w) is the min)
iff every rank hashed the same bytes. The tensor has a fixed size, so each rank
moves O(1) bytes at any world, where an all-gather moves world x the payload and an
object collective also unpickles what peers sent. 32-bit words keep the negation
exact in int64. Flags (a local error, a cache miss) ride in the same all-reduce.
Details are exchanged (``all_gather_bytes``) only once ``agree`` found a difference,
to name which ranks differ and how. Reports go to one rank (``gather_bytes``).

`ReductionHandle` is the asynchronous-completion type shared by DataParallel,
fully_shard and the pipeline runtime.

[Note: AVG is SUM plus a divide]
``ReduceOp.AVG`` is trusted only on NCCL. gloo gained AVG late, as SUM plus a
division, and older gloo builds ignored the op in reduce-scatter altogether
(pytorch/pytorch#162338), silently summing instead of averaging. Everywhere but
NCCL, ``op="avg"`` is therefore issued as SUM and divided by the group size when
the work is waited, so a result never depends on which release of which backend
ran it.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, NamedTuple, cast

import torch
import torch.distributed as dist

from cadence._groups.event_log import CommEvent, EventLog, phase
from cadence._groups.exchange import (
    CollectiveAlgorithms,
    ScratchPool,
    exchange_all_gather,
    exchange_all_reduce,
    exchange_reduce_scatter,
)
from cadence.errors import CadenceRuntimeError, CadenceValueError

__all__ = [
    "Agreement",
    "CollectiveAlgorithms",
    "Comm",
    "CommEvent",
    "CommWork",
    "EventLog",
    "ReduceOpName",
    "ReductionHandle",
    "phase",
]

ReduceOpName = Literal["sum", "avg", "max", "min"]
_After = Callable[[], object]  # run once a collective is done; its result is unused

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


# ---------------------------------------------------------------------------
# Works and handles
# ---------------------------------------------------------------------------


class CommWork:
    """A launched collective. ``wait()`` is idempotent; ``is_completed()`` never blocks.

    It keeps its tensors alive until waited, because the backend may still be
    reading or writing them (gloo runs the op on its own threads).
    """

    __slots__ = ("_after", "_done", "_event", "_lock", "_tensors", "_work")

    def __init__(
        self,
        work: Any | None,
        *,
        event: CommEvent | None = None,
        after: _After | None = None,
        tensors: Sequence[torch.Tensor] = (),
    ) -> None:
        self._work = work
        self._event = event
        self._after = after
        self._tensors = tuple(tensors)
        self._done = False
        self._lock = threading.Lock()

    def is_completed(self) -> bool:
        if self._done:
            return True
        return self._work is None or bool(self._work.is_completed())

    def wait(self) -> None:
        with self._lock:
            if self._done:
                return
            start = time.perf_counter()
            if self._event is not None:
                self._event.wait_began(start)
            if self._work is not None:
                # On NCCL this makes the current stream wait; it does not block the host.
                self._work.wait()
            if self._after is not None:
                self._after()
            if self._event is not None:
                self._event.waited_between(start, time.perf_counter())
            self._done = True
            self._work = None
            self._after = None
            self._tensors = ()


class ReductionHandle:
    """Completion of a gradient reduction, shared by DataParallel, fully_shard and pipelines.

    ``wait()`` waits the works in issue order and then runs ``on_complete`` (write
    the reduced gradients back, free buffers) exactly once. If ``on_complete``
    raises, the handle stays incomplete and a later ``wait()`` retries it; works
    already waited are not waited twice. ``is_completed()`` never blocks.
    """

    def __init__(
        self,
        works: Iterable[CommWork] = (),
        *,
        on_complete: Callable[[], None] | None = None,
        keepalive: Sequence[Any] = (),
        label: str = "",
    ) -> None:
        self._works = list(works)
        self._on_complete = on_complete
        self._keepalive = tuple(keepalive)
        self._done = False
        self._lock = threading.RLock()
        self.label = label

    @classmethod
    def completed(cls, label: str = "") -> ReductionHandle:
        handle = cls(label=label)
        handle._done = True
        return handle

    @property
    def num_works(self) -> int:
        return len(self._works)

    def is_completed(self) -> bool:
        """True once ``wait()`` finished, or when every collective has completed.

        The write-back has not necessarily run yet: call ``wait()`` to apply it.
        """
        return self._done or all(w.is_completed() for w in self._works)

    @property
    def done(self) -> bool:
        """True once ``wait()`` has returned (the results are visible)."""
        return self._done

    def wait(self) -> None:
        with self._lock:
            if self._done:
                return
            for work in self._works:
                work.wait()
            if self._on_complete is not None:
                self._on_complete()
            self._done = True
            self._works = []
            self._on_complete = None
            self._keepalive = ()

    def __repr__(self) -> str:
        state = "done" if self._done else f"{len(self._works)} works pending"
        return f"ReductionHandle({self.label or 'reduction'}, {state})"


# ---------------------------------------------------------------------------
# The adapter
# ---------------------------------------------------------------------------


class Agreement(NamedTuple):
    """What `Comm.agree` found: ``same`` digest on every rank; ``raised[i]``: any rank set flag i."""

    same: bool
    raised: tuple[bool, ...]


class Comm:
    """Collectives over one process group, optionally recorded in an `EventLog`.

    All ranks are *group* ranks. Every method issues asynchronously and returns a
    `CommWork`; with ``async_op=False`` the work is already waited.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        event_log: EventLog | None = None,
        name: str | None = None,
        algorithms: CollectiveAlgorithms | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise CadenceRuntimeError(
                "cadence.Comm needs an initialised process group; call cadence.init() first "
                "(or run under cadence.launch / torchrun)."
            )
        # WORLD is None only before init_process_group (checked above).
        self.group = group if group is not None else cast(dist.ProcessGroup, dist.group.WORLD)
        self.event_log = event_log
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.backend = str(dist.get_backend(self.group))
        self.name = name or f"group{self.world_size}"
        # See [Note: AVG is SUM plus a divide].
        self.native_avg = self.backend == "nccl"
        # See [Note: why cadence replaces some of gloo's collectives] in _groups/exchange.py.
        self.algorithms = algorithms if algorithms is not None else CollectiveAlgorithms()
        self._scratch = ScratchPool()  # all-reduce exchanges only: same buckets every step

    @property
    def is_default_group(self) -> bool:
        """Whether this communicator runs on the default (world) group, the one a
        process rebuilds without being told which (see [Note: pickling a wrapper])."""
        return self.group is dist.group.WORLD

    # -- helpers --------------------------------------------------------------

    def _event(self, kind: str, tensor: torch.Tensor | None, **meta: Any) -> CommEvent | None:
        if self.event_log is None:
            return None
        return self.event_log.record(kind, self.name, tensor, **meta)

    def _exchanges(self, kind: str, tensor: torch.Tensor) -> bool:
        return self.algorithms.uses_exchange(kind, self.backend, tensor, self.world_size)

    @staticmethod
    def _finish(work: CommWork, async_op: bool) -> CommWork:
        if not async_op:
            work.wait()
        return work

    def _op(self, op: ReduceOpName, target: torch.Tensor) -> tuple[Any, _After | None]:
        if op == "avg":
            if self.native_avg:
                return dist.ReduceOp.AVG, None
            world = self.world_size
            return dist.ReduceOp.SUM, lambda: target.div_(world)
        if op not in _OPS:
            raise CadenceValueError(f"unknown reduce op {op!r}; use one of sum, avg, max, min")
        return _OPS[op], None

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    # -- collectives ----------------------------------------------------------

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOpName = "sum", async_op: bool = False
    ) -> CommWork:
        torch_op, after = self._op(op, tensor)
        if torch_op == dist.ReduceOp.SUM and self._exchanges("all_reduce", tensor):
            event = self._event("all_reduce", tensor, op=op, algorithm="exchange")
            work: object = exchange_all_reduce(
                self.group, tensor, self.rank, self.world_size, self._scratch
            )
        else:
            event = self._event("all_reduce", tensor, op=op)
            work = dist.all_reduce(tensor, op=torch_op, group=self.group, async_op=True)
        return self._finish(CommWork(work, event=event, after=after, tensors=(tensor,)), async_op)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> CommWork:
        if output.numel() != input.numel() * self.world_size:
            raise CadenceValueError(
                f"all_gather_single: output has {output.numel()} elements, expected "
                f"{input.numel()} x world {self.world_size}"
            )
        work: object  # an ExchangeWork or torch's Work; CommWork takes either
        if self._exchanges("all_gather", output) and output.is_contiguous():
            event = self._event("all_gather", output, algorithm="exchange")
            work = exchange_all_gather(self.group, output, input, self.rank, self.world_size)
        else:
            event = self._event("all_gather", output)
            work = dist.all_gather_single(output, input, group=self.group, async_op=True)
        return self._finish(CommWork(work, event=event, tensors=(output, input)), async_op)

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        op: ReduceOpName = "sum",
        async_op: bool = False,
    ) -> CommWork:
        if input.numel() != output.numel() * self.world_size:
            raise CadenceValueError(
                f"reduce_scatter_single: input has {input.numel()} elements, expected "
                f"{output.numel()} x world {self.world_size}"
            )
        torch_op, after = self._op(op, output)
        if (
            torch_op == dist.ReduceOp.SUM
            and self._exchanges("reduce_scatter", input)
            and input.is_contiguous()
            and output.is_contiguous()
        ):
            event = self._event("reduce_scatter", input, op=op, algorithm="exchange")
            work = exchange_reduce_scatter(self.group, output, input, self.rank, self.world_size)
            # The exchange keeps ``input`` alive until its sum is done, and no longer:
            # see [Note: who keeps a reduce-scatter input alive] in fsdp/_root_runtime.py.
            return self._finish(
                CommWork(work, event=event, after=after, tensors=(output,)), async_op
            )
        else:
            event = self._event("reduce_scatter", input, op=op)
            torch_work = dist.reduce_scatter_single(
                output, input, op=torch_op, group=self.group, async_op=True
            )
        return self._finish(
            CommWork(torch_work, event=event, after=after, tensors=(output, input)), async_op
        )

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, async_op: bool = False) -> CommWork:
        event = self._event("broadcast", tensor, src=src)
        work = dist.broadcast(tensor, group=self.group, group_src=src, async_op=True)
        return self._finish(CommWork(work, event=event, tensors=(tensor,)), async_op)

    def isend(self, tensor: torch.Tensor, dst: int, *, tag: int = 0) -> CommWork:
        event = self._event("send", tensor, peer=dst)
        work = dist.isend(tensor, group=self.group, group_dst=dst, tag=tag)
        return CommWork(work, event=event, tensors=(tensor,))

    def irecv(self, tensor: torch.Tensor, src: int, *, tag: int = 0) -> CommWork:
        event = self._event("recv", tensor, peer=src)
        work = dist.irecv(tensor, group=self.group, group_src=src, tag=tag)
        return CommWork(work, event=event, tensors=(tensor,))

    def batch_isend_irecv(
        self, ops: Sequence[tuple[Literal["send", "recv"], torch.Tensor, int]]
    ) -> list[CommWork]:
        """Post several point-to-point ops together (one NCCL group); ``(kind, tensor, peer)``."""
        p2p = []
        events = []
        for kind, tensor, peer in ops:
            fn = dist.isend if kind == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, tensor, group=self.group, group_peer=peer))
            events.append(self._event(kind, tensor, peer=peer))
        works = dist.batch_isend_irecv(p2p) if p2p else []
        return [CommWork(w, event=e, tensors=(t,)) for w, e, (_, t, _) in zip(works, events, ops)]

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._event("all_gather_object", None)
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, *, src: int = 0) -> Any:
        self._event("broadcast_object", None)
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=src)
        return box[0]

    # -- setup and teardown: sizes that do not grow with the world -------------

    def agree(self, data: bytes = b"", flags: Sequence[bool] = ()) -> Agreement:
        """Whether every rank passed the same ``data``, and which ``flags`` any rank set.

        One all-reduce of ``8 * (16 + len(flags))`` bytes, recorded as ``"agree"``,
        whatever the world size and however long ``data`` is. Nothing a peer sends is
        unpickled. See [Note: agreeing by digest].
        """
        digest = hashlib.sha256(data).digest()
        words = [int.from_bytes(digest[i : i + 4], "big") for i in range(0, len(digest), 4)]
        vec = torch.tensor(
            [*words, *(-w for w in words), *(int(bool(f)) for f in flags)],
            dtype=torch.int64,
            device=_group_device(self.backend),
        )
        event = self._event("agree", vec)
        work = dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._finish(CommWork(work, event=event, tensors=(vec,)), False)
        got = vec.tolist()
        n = len(words)
        same = all(got[i] == -got[n + i] for i in range(n))
        return Agreement(same, tuple(v != 0 for v in got[2 * n :]))

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` in rank order (world x the longest: only after a difference)."""
        device = _group_device(self.backend)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=device)
        self.all_gather_single(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device))
        longest = int(sizes.max())
        every = torch.empty(longest * self.world_size, dtype=torch.uint8, device=device)
        self.all_gather_single(every, _padded(data, longest, device))
        raw = _to_bytes(every)
        return [raw[r * longest : r * longest + n] for r, n in enumerate(sizes.tolist())]

    def gather_bytes(self, data: bytes, *, dst: int = 0) -> list[bytes] | None:
        """Every rank's ``data`` on group rank ``dst`` (None elsewhere).

        A rank other than ``dst`` sends 8 bytes and the longest rank's payload: the
        caller bounds each rank's ``data``, and so ``dst``'s memory too.
        """
        device = _group_device(self.backend)
        longest = torch.tensor([len(data)], dtype=torch.int64, device=device)
        self.all_reduce(longest, op="max")
        width = 8 + int(longest.item())  # a length header, then the padded payload
        mine = _padded(len(data).to_bytes(8, "big") + data, width, device)
        out = None
        if self.rank == dst:
            out = torch.empty(width * self.world_size, dtype=torch.uint8, device=device)
        event = self._event("gather", out if out is not None else mine, dst=dst)
        parts = list(out.chunk(self.world_size)) if out is not None else None
        work = dist.gather(mine, parts, group=self.group, group_dst=dst, async_op=True)
        self._finish(CommWork(work, event=event, tensors=(mine, *(parts or ()))), False)
        if out is None:
            return None
        raw = _to_bytes(out)
        rows = [raw[r * width : (r + 1) * width] for r in range(self.world_size)]
        return [row[8 : 8 + int.from_bytes(row[:8], "big")] for row in rows]

    def barrier(self) -> None:
        self._event("barrier", None)
        # A tiny all-reduce instead of dist.barrier(): gloo's barrier ignores the group's
        # device and NCCL's warns without a device id; an all-reduce works on both.
        flag = torch.zeros(1, device=_group_device(self.backend))
        dist.all_reduce(flag, group=self.group)


def _padded(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    if data:
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out.to(device)


def _to_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.cpu().contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel())


def _group_device(backend: str) -> torch.device:
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
