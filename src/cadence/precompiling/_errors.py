"""The errors and warnings of `cadence.precompile`.

Every error derives from `cadence.errors.CadenceError` and keeps the builtin base a
caller would expect, so ``except ValueError`` around a bad argument keeps working.
This module imports nothing but cadence's error base, so every other module of the
package can import it without a cycle.
"""

from __future__ import annotations

from cadence.errors import CadenceError

__all__ = [
    "ArtifactRefused",
    "CacheRefusedWarning",
    "FrozenStateError",
    "GuardFailureError",
    "LocalCompileWarning",
    "PrecompileError",
    "PrecompileUsageError",
    "RankMismatchError",
]


class PrecompileError(CadenceError, RuntimeError):
    """Precompiling failed: the compile raised, or the rank that compiles reported a failure."""


class PrecompileUsageError(CadenceError, ValueError, TypeError):
    """A precompile argument or setting is invalid; raised before any compile, and before
    any collective unless it may differ between ranks (``CADENCE_JOB_SECRET``): that is
    raised on every rank after the first vote."""


class FrozenStateError(PrecompileError, ValueError):
    """A tensor, Parameter or stateful module is reached through a closure, a global or a
    default value: the artifact would carry a frozen copy of it, so refused.

    ``.paths`` lists where each offending value sits (``fn.__closure__ 'w'``, ``global W``).
    """

    def __init__(self, message: str, paths: list[str]) -> None:
        super().__init__(message)
        self.paths = paths


class GuardFailureError(PrecompileError):
    """A call does not match what was compiled (shape, dtype, grad mode, thread count,
    ``training`` flag, a captured global...). ``.guards`` lists the failed checks."""

    def __init__(self, message: str, guards: list[str]) -> None:
        super().__init__(message)
        self.guards = guards


class RankMismatchError(PrecompileError, ValueError):
    """Ranks of one group called precompile with different inputs, code or environments."""


class CacheRefusedWarning(UserWarning):
    """A cached artifact was refused (corrupt, stale, incompatible) and is compiled again."""


class LocalCompileWarning(UserWarning):
    """A guard failed and ``on_guard_failure="compile"`` compiled this rank on its own."""


class ArtifactRefused(Exception):
    """An artifact that must not be loaded; ``reason`` says why, in words.

    A signal inside the package, not an error a caller sees: the loaders catch it
    and either compile instead or raise `PrecompileError` with the reason. So it is
    deliberately not a `CadenceError` (an ``except CadenceError`` inside cadence must
    not swallow it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
