"""The errors and warnings of cadence.pickling.

Each error derives from `cadence.errors.CadenceError` (catch everything cadence refused
in one clause) *and* from the standard pickle error a caller of the standard pickler
already catches, so switching from ``pickle`` or cloudpickle changes no ``except``
clause: dumping raises ``pickle.PicklingError`` subclasses, loading raises
``pickle.UnpicklingError`` subclasses.

This module imports nothing from cadence.pickling, so every layer (reducers, the
pickler, the reconstructors a payload calls while it loads, the envelope) can raise
these without an import cycle.
"""

from __future__ import annotations

import pickle

from cadence.errors import CadenceError

# Everything not listed here is private to cadence.pickling.
__all__ = [
    "EnvelopeError",
    "ForbiddenGlobalError",
    "IncompatiblePayloadError",
    "MalformedPayloadError",
    "PrunedSlotWarning",
    "RecursionDepthError",
    "SignatureError",
    "UnpicklableError",
    "UnsafeAllowlistError",
]


class UnpicklableError(CadenceError, pickle.PicklingError, TypeError):
    """An object no pickler can rebuild (a generator, a frame, standard input, ...).

    A ``TypeError`` as well, so code catching the standard pickler's
    ``TypeError: cannot pickle ...`` still works.
    """


class RecursionDepthError(CadenceError, pickle.PicklingError):
    """The object graph nests deeper than the interpreter's recursion limit allows.

    The message names the path from the root to the object at which the stack ran out.
    """


class PrunedSlotWarning(UserWarning):
    """An optional function slot did not pickle and was left out of the payload."""


class EnvelopeError(CadenceError, pickle.UnpicklingError):
    """A payload refused before its objects were rebuilt.

    Raised by `loads_signed` for an envelope that does not verify, and by the
    reconstructors for a payload this interpreter or this cadence cannot read.
    """


class SignatureError(EnvelopeError):
    """Not a cadence signed payload, or its HMAC tag does not verify (tampered, wrong key)."""


class IncompatiblePayloadError(EnvelopeError):
    """An authentic payload made by an incompatible format or interpreter version."""


class ForbiddenGlobalError(CadenceError, pickle.UnpicklingError):
    """A restricted load met a global (class, function, module attribute) not allowed.

    ``global_name`` is the refused ``"module.qualname"``.
    """

    def __init__(self, message: str, global_name: str = "") -> None:
        super().__init__(message)
        self.global_name = global_name

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # The default reduce would rebuild it from ``args`` alone and lose the name.
        return type(self), (self.args[0], self.global_name)


class MalformedPayloadError(CadenceError, pickle.UnpicklingError):
    """Bytes a restricted load cannot read as a pickle: cut short, or an unknown opcode.

    A length prefix that claims more bytes than the payload holds raises this before
    anything of that length is allocated.
    """


class UnsafeAllowlistError(CadenceError, ValueError):
    """An `Allowlist` that would admit code-running modules or globals, refused when built.

    ``refused`` lists each refused pattern or global as written. A ``ValueError`` as well,
    as the allowlist's other misuse errors are.
    """

    def __init__(self, message: str, refused: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.refused = refused

    def __reduce__(self) -> tuple[type, tuple[str, tuple[str, ...]]]:
        # The default reduce would rebuild it from ``args`` alone and lose the entries.
        return type(self), (self.args[0], self.refused)
