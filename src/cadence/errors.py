"""The one base class of cadence's own errors, and its builtin-flavoured children.

Every error cadence raises for a reason of its own (misuse, a bad schedule, a plan
that differs across ranks, a failed rank) derives from `CadenceError`, so a caller
can catch "anything cadence refused" in one clause. Each concrete error also keeps
the builtin base a user would expect (``ValueError`` for bad input, ``TypeError``
for a wrong type, ``RuntimeError`` for a state that forbids the call), so existing
``except ValueError`` code keeps working.

The three generic children below serve errors that need no class of their own (a
bad argument, a wrong type, a call the current state forbids). An area whose
errors a user wants to catch separately defines its own class on top of them
(`cadence.fsdp.FullyShardError`, `cadence.data_parallel.DataParallelError`,
`cadence.LaunchError`).

Where errors live: the classes of the top-level modules are here; each package
keeps its own in one module, ``<package>/_errors.py`` (``pipeline/runtime/errors.py``,
whose path users import), which the package re-exports. The single exception is
`cadence.launch.LaunchError`, built from launch's ``RankFailure`` records, which this
module cannot import. ``tests/test_errors_home.py`` holds the rule.

This module imports nothing but the standard library: the torch-free schedule layer
raises these errors too.
"""

from __future__ import annotations

__all__ = [
    "CadenceError",
    "CadenceRuntimeError",
    "CadenceTypeError",
    "CadenceValueError",
    "OverlapStepError",
    "SubtestFailure",
    "UnreducedGradientError",
    "UntrustedPathError",
    "UsageError",
]


class CadenceError(Exception):
    """Base of every error that cadence raises on purpose."""


class CadenceValueError(CadenceError, ValueError):
    """An argument cadence refuses: the message names the value and an accepted one."""


class CadenceTypeError(CadenceError, TypeError):
    """An argument of a type cadence does not accept: the message lists the accepted types."""


class CadenceRuntimeError(CadenceError, RuntimeError):
    """A call the current state forbids: the message names the state and how to leave it."""


class UsageError(CadenceValueError):
    """A command line the ``cadence`` parser cannot parse (argparse's error)."""

    def __init__(self, message: str, prog: str) -> None:
        super().__init__(message)
        self.prog = prog


class OverlapStepError(CadenceRuntimeError):
    """Something done between backward and ``opt.step()`` that an overlapped step cannot honour."""


class UntrustedPathError(CadenceError, PermissionError):
    """A key or a folder that someone other than the current user could have written."""


class UnreducedGradientError(CadenceRuntimeError):
    """``.grad`` was used while its reduction was still pending (see `PendingGrad`)."""


class SubtestFailure(CadenceError, AssertionError):
    """One sub-case of `run_subtests` failed; the message names the case."""
