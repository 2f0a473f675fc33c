"""torch's ``torch.distributed.pipelining`` API on cadence's pipeline runtime.

Change the import line and keep the script::

    from cadence.pipelining import pipeline, SplitPoint, PipelineStage, ScheduleGPipe

`PipelineStage` and the ``Schedule*`` classes take torch's arguments; every schedule
also takes torch's own stages (``Pipe.build_stage`` output included). Underneath,
cadence's generator writes the schedule, ``lower`` adds the transfers, the
simulator proves it and `PipelineRuntime` runs it on per-edge channels. Arguments
cadence cannot honour are refused with the reason and the fix; see
docs/pipeline.md, "Drop-in for torch.distributed.pipelining".
"""

from __future__ import annotations

from torch.distributed.pipelining import SplitPoint, pipe_split

from cadence.pipelining._pipe import Pipe, pipeline
from cadence.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from cadence.pipelining.stage import PipelineStage

__all__ = [
    "Pipe",
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
    "SplitPoint",
    "pipe_split",
    "pipeline",
]
