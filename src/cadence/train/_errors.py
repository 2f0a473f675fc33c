"""`cadence train`'s errors: a refused configuration, a checkpoint that cannot be
trusted or resumed, a collective that timed out.

The package's errors live here, and only here (see `cadence.errors`, "Where errors
live"). Torch-free: `train/config.py`, which is, raises them.
"""

from __future__ import annotations

from cadence.errors import CadenceError

__all__ = [
    "CheckpointError",
    "CollectiveTimeoutError",
    "ResumeRefusedError",
    "TrainConfigError",
]


class TrainConfigError(CadenceError, ValueError):
    """A ``cadence train`` flag (or flag combination) the run cannot honour."""


class CheckpointError(CadenceError, RuntimeError):
    """A checkpoint could not be written."""


class ResumeRefusedError(CadenceError, ValueError):
    """``--resume`` found a checkpoint this run cannot continue from."""


class CollectiveTimeoutError(CadenceError, TimeoutError):
    """A collective of a step waited longer than ``--collective-timeout`` for its peers."""
