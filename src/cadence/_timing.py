"""The gradient-timing verbs shared by DataParallel and fully_shard.

Pipeline code (and users) call only these, and never check which wrapper they
hold: see ``docs/architecture.md``. The methods set flags that the hooks read
later; none of them issues a collective except ``finalize_backward``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from cadence.comm import ReductionHandle

__all__ = ["GradientTiming"]


@runtime_checkable
class GradientTiming(Protocol):
    """What a data-parallel wrapper exposes to schedules and callers."""

    @property
    def require_manual_backward_finalization(self) -> bool:
        """True: backward launches reductions but the caller must ``finalize_backward()``."""
        ...

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Set the flag above; an error inside backward."""
        ...

    @property
    def should_finalize_after_backward(self) -> bool:
        """Queried after forward: will the coming backward leave reductions to finalize?"""
        ...

    def set_requires_gradient_sync(self, enabled: bool) -> None:
        """Whether backwards reduce (read when a backward starts) or accumulate locally."""
        ...

    def finalize_backward(self, *, async_op: bool = False) -> ReductionHandle | None:
        """Finish (or, with ``async_op``, hand back a handle for) every pending reduction."""
        ...
