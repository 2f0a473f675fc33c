"""`cadence.fsdp`'s error (re-exported there and by `cadence`).

The package's errors live here, and only here (see `cadence.errors`, "Where errors
live").
"""

from __future__ import annotations

from cadence.errors import CadenceRuntimeError, CadenceValueError

__all__ = ["FullyShardError", "FullyShardUnsupportedError", "FullyShardValueError"]


class FullyShardError(CadenceRuntimeError):
    """A misuse of a fully sharded module: the message names the cause and the fix.

    A `cadence.errors.CadenceError` and a ``RuntimeError``.
    """


class FullyShardValueError(FullyShardError, CadenceValueError):
    """A module or parameter that fully_shard refuses to shard, where FSDP2 raises ValueError.

    A container without ``forward`` (``nn.ModuleList``/``nn.ModuleDict``), a 0-dim
    parameter, a parameter tied into another unit: torch's ``fully_shard`` raises
    ``ValueError`` for these, so this error is one too (and a `FullyShardError`), and
    ``except ValueError`` code written for FSDP2 keeps working.
    """


class FullyShardUnsupportedError(FullyShardError, NotImplementedError):
    """A parameter layout fully_shard does not shard, where FSDP2 raises NotImplementedError.

    A non-contiguous parameter (a ``channels_last`` convolution's weight): torch's
    ``fully_shard`` raises ``NotImplementedError``, so this error is one too (and a
    `FullyShardError`), and code written for FSDP2 keeps catching it.
    """
