"""The one base class of cadence's own errors.

Every error cadence raises for a reason of its own (misuse, a bad schedule, a plan
that differs across ranks, a failed rank) derives from `CadenceError`, so a caller
can catch "anything cadence refused" in one clause. Each concrete error also keeps
the builtin base a user would expect (``ValueError`` for bad input, ``TypeError``
for a wrong type, ``RuntimeError`` for a state that forbids the call), so existing
``except ValueError`` code keeps working.

This module imports nothing but the standard library: the torch-free schedule layer
raises these errors too.
"""

from __future__ import annotations

__all__ = ["CadenceError"]


class CadenceError(Exception):
    """Base of every error that cadence raises on purpose."""
