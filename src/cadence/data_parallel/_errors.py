"""`cadence.data_parallel`'s error (re-exported there and by `cadence`).

The package's errors live here, and only here (see `cadence.errors`, "Where errors
live").
"""

from __future__ import annotations

from cadence.errors import CadenceRuntimeError, CadenceValueError

__all__ = ["DataParallelError", "NothingToReduceError"]


class DataParallelError(CadenceRuntimeError):
    """A call that DataParallel's current state forbids; the message names the fix.

    A `cadence.errors.CadenceError` and a ``RuntimeError``. Raised locally, before
    any collective, so no rank is left waiting in one.
    """


class NothingToReduceError(DataParallelError, CadenceValueError):
    """The module has no parameter that requires grad: there is nothing to reduce.

    A ``RuntimeError``, as torch DDP raises for the same module (a script that catches
    DDP's error catches this one), and a ``ValueError``, as cadence raises for a bad
    argument.
    """
