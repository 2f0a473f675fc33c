"""The pipeline runtime: stages, the executor of lowered schedules, channel groups,
gradient sync of data-parallel stages, microbatching, and `build_pipeline`.

Modules (each importing only those before it, and the schedule layer):

- ``errors``: `PipelineUsageError`, `PipelineStateError`, `PlanMismatchError`,
  `StageShapeError`, `PipelineRuntimeError`.
- ``stage``: `Stage` (F, B, I, W of one module chunk; shape checks).
- ``split_backward``: the I/W split of one microbatch's backward.
- ``microbatch``: `split_microbatches`, `merge_microbatches`, `LossPolicy`.
- ``metadata``: every rank agrees on the stages' tensor metadata.
- ``tied``: parameters tied across stages.
- ``grad_sync``: `StageGradSync`, REDUCE_GRAD / WAIT_REDUCE_GRAD through the public
  timing verbs of a data-parallel wrapper.
- ``groups``: channels -> process groups (plan vote, creation, preconnect, cache).
- ``executor``: `PipelineRuntime`, which runs this rank's lowered `Action` list.
- ``build``: `build_pipeline`, from a schedule name and stage modules to a runtime.
"""

from __future__ import annotations

from cadence.pipeline.runtime.build import build_pipeline, torch_lowered_schedule
from cadence.pipeline.runtime.errors import (
    PipelineRuntimeError,
    PipelineStateError,
    PipelineUsageError,
    PlanMismatchError,
    StageShapeError,
)
from cadence.pipeline.runtime.executor import PipelineRuntime
from cadence.pipeline.runtime.grad_sync import StageGradSync
from cadence.pipeline.runtime.groups import ChannelGroups, build_channel_groups
from cadence.pipeline.runtime.microbatch import LossPolicy, merge_microbatches, split_microbatches
from cadence.pipeline.runtime.stage import Stage, TensorMeta

__all__ = [
    "ChannelGroups",
    "LossPolicy",
    "PipelineRuntime",
    "PipelineRuntimeError",
    "PipelineStateError",
    "PipelineUsageError",
    "PlanMismatchError",
    "Stage",
    "StageGradSync",
    "StageShapeError",
    "TensorMeta",
    "build_channel_groups",
    "build_pipeline",
    "merge_microbatches",
    "split_microbatches",
    "torch_lowered_schedule",
]
