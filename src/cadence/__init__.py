"""cadence: PyTorch distributed training in which the caller owns the timing.

Gradient reductions run in the background and finish exactly when and where the
caller says. See the README for the feature table and the overlap patterns.
"""

from cadence import pickling, pipeline, testing
from cadence._dist_init import init
from cadence.comm import Comm, CommEvent, CommWork, EventLog, ReductionHandle
from cadence.data_parallel import DataParallel, WindowState
from cadence.fsdp import FullyShardedModule, MixedPrecisionPolicy, fully_shard
from cadence.launch import LaunchError, launch
from cadence.pipeline import PipelineStage, Schedule, build_pipeline
from cadence.topology import Coords, ParallelGroups, Topology

__version__ = "0.1.0"

__all__ = [
    "Comm",
    "CommEvent",
    "CommWork",
    "Coords",
    "DataParallel",
    "EventLog",
    "FullyShardedModule",
    "LaunchError",
    "MixedPrecisionPolicy",
    "ParallelGroups",
    "PipelineStage",
    "ReductionHandle",
    "Schedule",
    "Topology",
    "WindowState",
    "__version__",
    "build_pipeline",
    "fully_shard",
    "init",
    "launch",
    "pickling",
    "pipeline",
    "testing",
]
