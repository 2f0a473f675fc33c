"""The embedded models' error: a model that does not declare the block protocol.

The package's errors live here, and only here (see `cadence.errors`, "Where errors
live").
"""

from __future__ import annotations

from cadence.errors import CadenceValueError

__all__ = ["BlockProtocolError"]


class BlockProtocolError(CadenceValueError):
    """A model that does not declare (or wrongly declares) the block protocol."""
