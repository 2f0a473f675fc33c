"""The errors of the pipeline runtime, all `cadence.errors.CadenceError`s.

Each keeps the builtin base a caller would expect, so ``except ValueError`` around a
bad argument, or ``except RuntimeError`` around a failed step, keeps working.
"""

from __future__ import annotations

from typing import Any

from cadence.errors import CadenceError

__all__ = [
    "PipelineRuntimeError",
    "PipelineStateError",
    "PipelineUsageError",
    "PlanMismatchError",
    "StageShapeError",
]


class PipelineUsageError(CadenceError, ValueError):
    """A pipeline cannot be built or stepped as asked (arguments, stages, batch).

    Raised on the rank that sees the problem before it communicates; setup errors
    that only one rank can see travel with the plan vote (see `PlanMismatchError`).
    """


class PipelineStateError(CadenceError, RuntimeError):
    """A call that the current state of a stage or step forbids (e.g. W before its I).

    Inside ``PipelineRuntime.step`` it surfaces as the cause of a
    `PipelineRuntimeError` that names the failing action.
    """


class PlanMismatchError(CadenceError, RuntimeError):
    """Ranks disagree on the pipeline plan, or one rank's setup failed.

    Raised on every rank by the plan vote, before any channel group is created.
    """


class StageShapeError(CadenceError, ValueError):
    """A tensor entering or leaving a stage does not match the agreed metadata."""


class PipelineRuntimeError(CadenceError, RuntimeError):
    """An action failed; the message carries the rank's schedule with it marked.

    Attributes:
        rank: the pipeline rank (position in the pp group).
        index: the failing action's index in that rank's lowered list.
        action: the failing `Action`.
    """

    def __init__(self, message: str, *, rank: int, index: int, action: Any) -> None:
        super().__init__(message)
        self.rank = rank
        self.index = index
        self.action = action
