"""The benchmarks' error.

The package's errors live here, and only here (see `cadence.errors`, "Where errors
live").
"""

from __future__ import annotations

from cadence.errors import CadenceRuntimeError

__all__ = ["MemoryProbeError"]


class MemoryProbeError(CadenceRuntimeError):
    """The kernel does not let this process reset its RSS high-water mark."""
