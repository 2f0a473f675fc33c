"""The emulated link's error.

The package's errors live here, and only here (see `cadence.errors`, "Where errors
live").
"""

from __future__ import annotations

from cadence.errors import CadenceRuntimeError

__all__ = ["LinkUnavailableError"]


class LinkUnavailableError(CadenceRuntimeError):
    """This machine cannot make the emulated link: a tool or a privilege is missing.

    The message names what is missing and how to get it. A link that cannot be shaped
    is never replaced by an unshaped one: every figure taken on it would be wrong.
    """
