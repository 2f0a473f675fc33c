"""What the simulator is told and what it reports: `TimeModel`, `MemoryModel`,
`SimResult`, the errors it raises, and its record of one posted transfer.

Plain values, kept apart from the event loop in ``sim.py`` (which re-exports them);
see [Note: simulator semantics] there for how they are used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from cadence.pipeline.schedule._errors import (
    FifoMismatchError,
    ScheduleDeadlockError,
    ScheduleValidationError,
)
from cadence.pipeline.schedule.ir import Action, ActionKind

__all__ = [
    "FifoMismatchError",
    "MemoryModel",
    "ScheduleDeadlockError",
    "SimResult",
    "TimeModel",
]


@dataclass(frozen=True)
class TimeModel:
    """Per-kind durations of a *full* stage (divided by v per chunk if
    ``scale_by_chunks``), and comm cost alpha + bytes / beta per message."""

    f: float = 1.0
    i: float = 1.0
    w: float = 1.0
    b: float | None = None  # full backward; default i + w
    scale_by_chunks: bool = True
    alpha: float = 0.0
    beta: float = math.inf
    message_bytes: float = 0.0
    start_delay: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("f", "i", "w", "alpha"):
            if getattr(self, name) < 0:
                raise ScheduleValidationError(f"TimeModel.{name} must be >= 0")
        if self.beta <= 0:
            raise ScheduleValidationError("TimeModel.beta (bytes per time unit) must be > 0")

    def duration(self, a: Action, v: int) -> float:
        base = {
            ActionKind.F: self.f,
            ActionKind.I: self.i,
            ActionKind.W: self.w,
            ActionKind.B: self.b if self.b is not None else self.i + self.w,
        }
        total = sum(base[c.kind] for c in a.compute_parts())
        return total / v if self.scale_by_chunks else total

    def comm(self) -> float:
        return self.alpha + (self.message_bytes / self.beta if self.message_bytes else 0.0)


@dataclass(frozen=True)
class MemoryModel:
    """Memory of one chunk's activations for one microbatch, and of one stage's
    unsharded parameters, in any one unit."""

    activation: float = 1.0
    parameters: float = 1.0

    def __post_init__(self) -> None:
        if self.activation < 0 or self.parameters < 0:
            raise ScheduleValidationError("MemoryModel sizes must be >= 0")


@dataclass(frozen=True)
class SimResult:
    """What a simulation found. Times are in `TimeModel` units."""

    makespan: float
    busy: tuple[float, ...]
    span: tuple[float, ...]
    bubble: float  # idle / (p * makespan)
    bubble_in_span: float  # idle / sum of each rank's busy span
    peak_inflight: tuple[int, ...]  # chunk activations alive at once, per rank
    mode: str
    send: str
    events: tuple[tuple[int, str, float, float], ...] = field(
        repr=False, default=()
    )  # rank, action, start, end
    flows: tuple[tuple[int, int, float, float, str], ...] = field(
        repr=False, default=()
    )  # src, dst, t_send, t_recv, label
    peak_memory: tuple[float, ...] = ()  # activations + resident parameters, per rank
    peak_reductions: tuple[int, ...] = ()  # reductions in flight at once, per rank

    def summary(self) -> str:
        lines = [
            f"makespan {self.makespan:g}, bubble {self.bubble:.4f} (idle / (p x makespan)), "
            f"bubble within rank spans {self.bubble_in_span:.4f}"
        ]
        for r, (b, pk) in enumerate(zip(self.busy, self.peak_inflight, strict=True)):
            mem = f", peak memory {self.peak_memory[r]:g}" if self.peak_memory else ""
            lines.append(
                f"  rank {r}: busy {b:g}, idle {self.makespan - b:g}, "
                f"peak in-flight activations {pk}{mem}"
            )
        return "\n".join(lines)


class _Op:
    __slots__ = (
        "action",
        "channel",
        "done",
        "group",
        "index",
        "match",
        "pos",
        "post",
        "qpos",
        "rank",
    )

    def __init__(
        self,
        rank: int,
        index: int,
        action: Action,
        channel: tuple[int, int],
        group: Any,
        post: float,
    ) -> None:
        self.rank, self.index, self.action, self.channel, self.group = (
            rank,
            index,
            action,
            channel,
            group,
        )
        self.post = post
        self.match: float | None = None
        self.done: float | None = None
        self.pos = -1
        self.qpos = -1  # index in its communicator queue
