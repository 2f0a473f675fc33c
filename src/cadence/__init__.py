"""cadence: PyTorch distributed training in which the caller owns the timing.

Gradient reductions run in the background and finish exactly when and where the
caller says. See the README for the feature table and the overlap patterns.

Names are imported on first use, so ``import cadence`` is cheap and works without
torch for the parts that do not need it (``cadence.pickling``,
``cadence.pipeline.schedule``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence._util.lazy import lazy_getattr
from cadence._util.version import __version__
from cadence.errors import CadenceError

# Eager, and torch-free: the submodule ``cadence.launch`` would otherwise shadow the
# function of the same name once anything imports the module.
from cadence.launch import LaunchError, launch

# What a user writes. The plumbing those names hand back (a collective's work and
# event, a data-parallel window's state, a rank's coordinates) is imported from its
# own module: `cadence.comm`, `cadence.data_parallel`, `cadence.topology`.

_LAZY = {
    "Comm": "cadence.comm:Comm",
    "CollectiveAlgorithms": "cadence.comm:CollectiveAlgorithms",
    "DataParallel": "cadence.data_parallel:DataParallel",
    "EventLog": "cadence.comm:EventLog",
    "FullyShardedModule": "cadence.fsdp:FullyShardedModule",
    "GradientTiming": "cadence._grad_timing.timing:GradientTiming",
    "MixedPrecisionPolicy": "cadence.fsdp:MixedPrecisionPolicy",
    "ParallelGroups": "cadence.topology:ParallelGroups",
    "ReductionHandle": "cadence.comm:ReductionHandle",
    "Schedule": "cadence.pipeline:Schedule",
    "Topology": "cadence.topology:Topology",
    "build_pipeline": "cadence.pipeline:build_pipeline",
    "fully_shard": "cadence.fsdp:fully_shard",
    "gradient_timing": "cadence._grad_timing.torch_timing:gradient_timing",
    "init": "cadence._groups.dist_init:init",
    "pickling": "cadence.pickling",
    "pipeline": "cadence.pipeline",
    "pipelining": "cadence.pipelining",
    "precompile": "cadence.precompiling:precompile",
    "precompiling": "cadence.precompiling",
    "testing": "cadence.testing",
}

__getattr__ = lazy_getattr("cadence", _LAZY, globals())

if TYPE_CHECKING:  # static tools see the eager imports
    from cadence import pickling, pipeline, precompiling, testing
    from cadence._grad_timing.timing import GradientTiming
    from cadence._grad_timing.torch_timing import gradient_timing
    from cadence._groups.dist_init import init
    from cadence.comm import (
        CollectiveAlgorithms,
        Comm,
        EventLog,
        ReductionHandle,
    )
    from cadence.data_parallel import DataParallel
    from cadence.fsdp import FullyShardedModule, MixedPrecisionPolicy, fully_shard
    from cadence.pipeline import Schedule, build_pipeline
    from cadence.precompiling import precompile
    from cadence.topology import ParallelGroups, Topology

__all__ = [
    "CadenceError",
    "CollectiveAlgorithms",
    "Comm",
    "DataParallel",
    "EventLog",
    "FullyShardedModule",
    "GradientTiming",
    "LaunchError",
    "MixedPrecisionPolicy",
    "ParallelGroups",
    "ReductionHandle",
    "Schedule",
    "Topology",
    "__version__",
    "build_pipeline",
    "fully_shard",
    "gradient_timing",
    "init",
    "launch",
    "pickling",
    "pipeline",
    "pipelining",
    "precompile",
    "precompiling",
    "testing",
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
