"""`cadence.data_parallel`'s error (re-exported there and by `cadence`).

The package's errors live here, and only here (see `cadence.errors`, "Where errors
live").
"""

from __future__ import annotations

from cadence.errors import CadenceRuntimeError

__all__ = ["DataParallelError"]


class DataParallelError(CadenceRuntimeError):
    """A call that DataParallel's current state forbids; the message names the fix.

    A `cadence.errors.CadenceError` and a ``RuntimeError``. Raised locally, before
    any collective, so no rank is left waiting in one.
    """
