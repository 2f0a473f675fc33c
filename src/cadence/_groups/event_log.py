"""`EventLog`: an opt-in record of every collective and user mark, on one clock.

`cadence.Comm` records into it (and `CommWork.wait` closes each record), the wrappers
take one as ``event_log=``, and tests and benchmarks read it to prove counts, order
and overlap independently of the backend. Re-exported by `cadence.comm` and
`cadence`.

[Note: a long run's log stays bounded]
A training run issues collectives every step for as long as it runs: kept whole,
the log would grow without end. ``capacity`` keeps the newest N events (a deque), and
the figures a run reports over its whole length are totals kept as events are
recorded and waited, not sums over what is still kept: ``total_counts``,
``total_wait_time`` and ``total_in_flight_time``. ``counts``, ``wait_time`` and
``in_flight_time`` read the kept events only (all of them without a capacity).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from cadence.errors import CadenceValueError


def phase(name: str, detail: object = "") -> contextlib.AbstractContextManager[Any]:
    """A range named ``cadence::<name><detail>`` in a ``torch.profiler`` trace.

    The event log records cadence's collectives on its own clock; a user who profiles
    with torch's profiler sees cadence's phases (a bucket's launch, a finalize, a
    unit's unshard, reshard and reduce-scatter, a pipeline action) among torch's own
    ops, as FSDP2's and pipelining's ranges show theirs.

    Without an active profiler no range is made at all. A ``record_function`` costs
    its enter and exit through the dispatcher even then: 17 us a range on an idle
    core, and about 125 us inside a step on 2 busy cores, where the bucket launches
    of dense AdamW (12 a step) paid 1.5 ms a rank on the critical path for ranges
    that nobody recorded. The profiler's flag is read on the calling thread, whose
    state autograd's worker threads inherit, so a range inside a hook still appears
    under a profiler started around the step. ``detail`` (a pipeline action, say) is
    formatted into the name only then, for the same reason.
    """
    if not torch.autograd._profiler_enabled():
        return _NO_RANGE
    return torch.profiler.record_function(f"cadence::{name}{detail}")


# Reusable: a nullcontext holds no state between uses.
_NO_RANGE: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()


__all__ = ["CommEvent", "EventLog", "phase"]


@dataclass
class CommEvent:
    """One collective (or one user mark) on the log's clock (``time.perf_counter``)."""

    seq: int
    kind: str
    group: str
    nbytes: int
    numel: int
    dtype: str
    issue_t: float
    wait_start_t: float | None = None
    wait_end_t: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # The log that recorded it, told when the wait ends (its running totals).
    log: EventLog | None = field(default=None, repr=False, compare=False)

    @property
    def waited(self) -> bool:
        return self.wait_end_t is not None

    def __getstate__(self) -> dict[str, Any]:
        # An event sent to another process (a test's result, a report) leaves its log.
        return {k: v for k, v in self.__dict__.items() if k != "log"} | {"log": None}

    def wait_began(self, start: float) -> None:
        """``wait()`` started at ``start``: set before blocking, so that a wait that never
        returns (a hung peer) is still visible as started and unfinished."""
        self.wait_start_t = start

    def waited_between(self, start: float, end: float) -> None:
        """Close the record: ``wait()`` ran from ``start`` to ``end``."""
        self.wait_start_t, self.wait_end_t = start, end
        if self.log is not None:
            self.log._count_wait(self)


class EventLog:
    """An opt-in, thread-safe record of collectives and user marks.

    Pass it to the wrappers (``event_log=``) or to a `Comm`. ``mark(name)`` records
    a user event on the same clock, so a test can assert e.g. that an all-reduce
    was issued before sparse work started and waited after it ended.
    """

    def __init__(self, capacity: int | None = None) -> None:
        """``capacity``: keep only the newest N events (a long run's memory stays bounded).

        ``total_counts()``, ``total_wait_time()`` and ``total_in_flight_time()`` still
        cover every collective ever recorded; see [Note: a long run's log stays bounded].
        """
        if capacity is not None and capacity < 1:
            raise CadenceValueError(f"EventLog capacity must be >= 1 or None, got {capacity}")
        self._lock = threading.Lock()
        self.capacity = capacity
        self.events: deque[CommEvent] = deque(maxlen=capacity)
        self._seq = 0
        self._totals: dict[str, int] = {}
        # See [Note: a long run's log stays bounded]: per kind, over every event.
        self._wait_totals: dict[str, float] = {}
        self._flight_totals: dict[str, float] = {}

    def _add(self, event: CommEvent) -> CommEvent:
        with self._lock:
            event.seq = self._seq
            event.log = self
            self._seq += 1
            self.events.append(event)
            self._totals[event.kind] = self._totals.get(event.kind, 0) + 1
        return event

    def _count_wait(self, event: CommEvent) -> None:
        assert event.wait_start_t is not None and event.wait_end_t is not None
        with self._lock:
            k = event.kind
            self._wait_totals[k] = self._wait_totals.get(k, 0.0) + (
                event.wait_end_t - event.wait_start_t
            )
            self._flight_totals[k] = self._flight_totals.get(k, 0.0) + (
                event.wait_start_t - event.issue_t
            )

    def total_wait_time(self, *kinds: str) -> float:
        """`wait_time` over every event since creation (or ``clear()``), evicted included."""
        with self._lock:
            return sum(v for k, v in self._wait_totals.items() if not kinds or k in kinds)

    def total_in_flight_time(self, *kinds: str) -> float:
        """`in_flight_time` over every event since creation (or ``clear()``), evicted included."""
        with self._lock:
            return sum(v for k, v in self._flight_totals.items() if not kinds or k in kinds)

    def total_counts(self) -> dict[str, int]:
        """Counts per kind since creation (or ``clear()``), including evicted events."""
        with self._lock:
            return {k: v for k, v in self._totals.items() if k != "mark"}

    def record(self, kind: str, group: str, tensor: torch.Tensor | None, **meta: Any) -> CommEvent:
        numel = tensor.numel() if tensor is not None else 0
        nbytes = numel * (tensor.element_size() if tensor is not None else 0)
        if tensor is not None and tensor.is_sparse:  # what it holds, not its dense size
            values, indices = tensor._values(), tensor._indices()
            numel = values.numel()
            nbytes = numel * values.element_size() + indices.numel() * indices.element_size()
        return self._add(
            CommEvent(
                seq=-1,
                kind=kind,
                group=group,
                nbytes=nbytes,
                numel=numel,
                dtype=str(tensor.dtype).removeprefix("torch.") if tensor is not None else "",
                issue_t=time.perf_counter(),
                meta=dict(meta),
            )
        )

    def mark(self, name: str, **meta: Any) -> CommEvent:
        """Record a user event (kind ``"mark"``); its ``issue_t`` is now."""
        now = time.perf_counter()
        return self._add(CommEvent(-1, "mark", name, 0, 0, "", now, now, now, meta=dict(meta)))

    def clear(self) -> None:
        with self._lock:
            self.events.clear()
            self._totals.clear()
            self._wait_totals.clear()
            self._flight_totals.clear()

    def collectives(self, kind: str | None = None, group: str | None = None) -> list[CommEvent]:
        with self._lock:
            events = list(self.events)
        return [
            e
            for e in events
            if e.kind != "mark"
            and (kind is None or e.kind == kind)
            and (group is None or e.group == group)
        ]

    def count(self, kind: str | None = None, group: str | None = None) -> int:
        return len(self.collectives(kind, group))

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.collectives():
            out[e.kind] = out.get(e.kind, 0) + 1
        return out

    def marks(self, name: str | None = None) -> list[CommEvent]:
        with self._lock:
            return [
                e for e in self.events if e.kind == "mark" and (name is None or e.group == name)
            ]

    def signature(self) -> list[tuple[str, int, str]]:
        """(kind, numel, dtype) per collective, in issue order: compare it across ranks."""
        return [(e.kind, e.numel, e.dtype) for e in self.collectives()]

    def _of_kinds(self, kinds: tuple[str, ...]) -> list[CommEvent]:
        events = self.collectives()
        return [e for e in events if not kinds or e.kind in kinds]

    def wait_time(self, *kinds: str) -> float:
        """Seconds blocked inside ``wait()`` (exposed communication), for ``kinds`` or all."""
        return sum(
            (e.wait_end_t - e.wait_start_t)
            for e in self._of_kinds(kinds)
            if e.wait_end_t is not None and e.wait_start_t is not None
        )

    def in_flight_time(self, *kinds: str) -> float:
        """Seconds between issue and the start of ``wait()``: communication the caller overlapped."""
        return sum(
            e.wait_start_t - e.issue_t for e in self._of_kinds(kinds) if e.wait_start_t is not None
        )
