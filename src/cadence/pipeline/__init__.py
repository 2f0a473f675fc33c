"""Pipeline parallelism: schedules as data, derived P2P channels, a simulator.

Two layers, and the arrow between them points one way:

- `cadence.pipeline.schedule`: the IR (`Action`, `Schedule`), generators, lowering
  passes, channels and their digest, the simulator (`verify`), pictures and the
  ``cadence schedule show`` logic. No process group, no torch.
- `cadence.pipeline.runtime`: `Stage`, the executor (`PipelineRuntime`),
  channel groups, gradient sync of data-parallel stages, microbatching and
  `build_pipeline`. It imports the schedule layer, never the reverse.

This package lists the names most programs need; everything else lives in the two
subpackages. Names are imported on first use, so ``import cadence.pipeline`` does
not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence._util.lazy import lazy_getattr

_S = "cadence.pipeline.schedule"
_R = "cadence.pipeline.runtime"

_LAZY = {
    "Action": f"{_S}.ir:Action",
    "ActionKind": f"{_S}.ir:ActionKind",
    "Schedule": f"{_S}.ir:Schedule",
    "ScheduleValidationError": f"{_S}.ir:ScheduleValidationError",
    "generate": f"{_S}.generators:generate",
    "lower": f"{_S}.passes:lower",
    "simulate": f"{_S}.sim:simulate",
    "verify": f"{_S}.sim:verify",
    "channel_plan": f"{_S}.channels:channel_plan",
    "Stage": f"{_R}.stage:Stage",
    "PipelineRuntime": f"{_R}.executor:PipelineRuntime",
    "build_pipeline": f"{_R}.build:build_pipeline",
    "schedule": _S,
    "runtime": _R,
}

__getattr__ = lazy_getattr("cadence.pipeline", _LAZY, globals())

if TYPE_CHECKING:  # static tools see the eager imports
    from cadence.pipeline import runtime as runtime
    from cadence.pipeline import schedule as schedule
    from cadence.pipeline.runtime.build import build_pipeline
    from cadence.pipeline.runtime.executor import PipelineRuntime
    from cadence.pipeline.runtime.stage import Stage
    from cadence.pipeline.schedule._errors import ScheduleValidationError
    from cadence.pipeline.schedule.channels import channel_plan
    from cadence.pipeline.schedule.generators import generate
    from cadence.pipeline.schedule.ir import Action, ActionKind, Schedule
    from cadence.pipeline.schedule.passes import lower
    from cadence.pipeline.schedule.sim import simulate, verify

__all__ = [
    "Action",
    "ActionKind",
    "PipelineRuntime",
    "Schedule",
    "ScheduleValidationError",
    "Stage",
    "build_pipeline",
    "channel_plan",
    "generate",
    "lower",
    "simulate",
    "verify",
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
