"""`cadence.fsdp`'s error (re-exported there and by `cadence`).

The package's errors live here, and only here (see `cadence.errors`, "Where errors
live").
"""

from __future__ import annotations

from cadence.errors import CadenceRuntimeError

__all__ = ["FullyShardError"]


class FullyShardError(CadenceRuntimeError):
    """A misuse of a fully sharded module: the message names the cause and the fix.

    A `cadence.errors.CadenceError` and a ``RuntimeError``.
    """
