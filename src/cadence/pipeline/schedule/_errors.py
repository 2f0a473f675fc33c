"""The schedule layer's errors: a schedule that breaks a rule, and one the simulator
proves deadlocks. Torch-free, like the layer.

The package's errors live here, and only here (see `cadence.errors`, "Where errors
live").
"""

from __future__ import annotations

from cadence.errors import CadenceError

__all__ = ["FifoMismatchError", "ScheduleDeadlockError", "ScheduleValidationError"]


class ScheduleValidationError(CadenceError, ValueError):
    """A schedule (or an input to the schedule layer) breaks a rule; the message names
    the rule, and for a schedule the rank and the action."""


class FifoMismatchError(ScheduleValidationError):
    """The i-th SEND and the i-th RECV on a channel carry different things."""


class ScheduleDeadlockError(CadenceError, RuntimeError):
    """No rank can progress. ``cycle``: [(rank, action text, channel, seq, waits_on_rank)];
    ``blocked``: rank -> (index, action text, reason)."""

    def __init__(
        self,
        message: str,
        cycle: list[tuple[int, str, tuple[int, int], int, int | None]],
        blocked: dict[int, tuple[int, str, str]],
    ) -> None:
        super().__init__(message)
        self.cycle = cycle
        self.blocked = blocked
