"""Pipeline parallelism: schedules as data, derived P2P channels, a simulator.

Two layers, and the arrow between them points one way:

- `cadence.pipeline.schedule`: the IR (`Action`, `Schedule`), generators, lowering
  passes, channels and their digest, the simulator (`verify`), pictures and the
  ``cadence schedule show`` logic. No process group, no torch.
- `cadence.pipeline.runtime`: `PipelineStage`, the executor (`PipelineRuntime`),
  channel groups, gradient sync of data-parallel stages, microbatching and
  `build_pipeline`. It imports the schedule layer, never the reverse.

This package lists the names most programs need; everything else lives in the two
subpackages. Names are imported on first use, so ``import cadence.pipeline`` does
not import torch. Names and modules that moved keep working for a deprecation
period, with a `DeprecationWarning` naming the new location.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence._lazy import alias_moved_modules, lazy_getattr

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
    "PipelineStage": f"{_R}.stage:PipelineStage",
    "PipelineRuntime": f"{_R}.executor:PipelineRuntime",
    "build_pipeline": f"{_R}.build:build_pipeline",
    "schedule": _S,
    "runtime": _R,
}

# Names this package exported before the schedule/runtime split: still served, with
# a DeprecationWarning that names their new home.
_MOVED = {
    name: f"{_S}:{name}"
    for name in (
        "GENERATORS",
        "IR_VERSION",
        "SCHEDULE_NAMES",
        "ChannelPlan",
        "FifoMismatchError",
        "Payload",
        "ScheduleDeadlockError",
        "ScheduleMeta",
        "SimResult",
        "TimeModel",
        "add_comms",
        "add_reduce_grad",
        "add_wait_reduce",
        "apply_parity_rule",
        "chrome_trace",
        "derive_channels",
        "describe_plan_difference",
        "dualpipev",
        "gpipe",
        "interleaved_1f1b",
        "loop_placement",
        "looped_bfs",
        "one_f_one_b",
        "parse_action",
        "placement_for",
        "plan_rounds",
        "v_placement",
        "validate_compute",
        "validate_lowered",
        "zb_h1",
        "zbv",
    )
} | {
    name: f"{_R}:{name}"
    for name in (
        "ChannelGroups",
        "LossPolicy",
        "PipelineRuntimeError",
        "PlanMismatchError",
        "StageGradSync",
        "StageShapeError",
        "TensorMeta",
        "build_channel_groups",
        "merge_microbatches",
        "split_microbatches",
    )
}

# Modules that moved: ``import cadence.pipeline.passes`` keeps working (and warns).
alias_moved_modules(
    {
        "cadence.pipeline.ir": (f"{_S}.ir", {}),
        "cadence.pipeline.generators": (f"{_S}.generators", {}),
        "cadence.pipeline.passes": (
            f"{_S}.passes",
            {"repair_deadlocks": f"{_S}.sim:repair_deadlocks"},
        ),
        "cadence.pipeline.sim": (f"{_S}.sim", {"chrome_trace": f"{_S}.viz:chrome_trace"}),
        "cadence.pipeline.topology": (f"{_S}.channels", {}),
        "cadence.pipeline.viz": (f"{_S}.viz", {}),
        "cadence.pipeline.cli": ("cadence.cli", {}),
        "cadence.pipeline.stage": (f"{_R}.stage", {}),
        "cadence.pipeline.microbatch": (f"{_R}.microbatch", {}),
        "cadence.pipeline.groups": (
            f"{_R}.groups",
            {"canonical_rounds": f"{_S}.channels:plan_rounds"},
        ),
        "cadence.pipeline.dp": (f"{_R}.grad_sync", {}),
        "cadence.pipeline._build": (
            f"{_R}.build",
            {
                "SCHEDULE_NAMES": f"{_S}.generators:SCHEDULE_NAMES",
                "placement_for": f"{_S}.generators:placement_for",
                "torch_schedule_name": f"{_S}.generators:torch_schedule_name",
            },
        ),
    }
)

__getattr__ = lazy_getattr("cadence.pipeline", _LAZY, globals(), _MOVED)

if TYPE_CHECKING:  # static tools see the eager imports
    from cadence.pipeline import runtime as runtime
    from cadence.pipeline import schedule as schedule
    from cadence.pipeline.runtime.build import build_pipeline
    from cadence.pipeline.runtime.executor import PipelineRuntime
    from cadence.pipeline.runtime.stage import PipelineStage
    from cadence.pipeline.schedule.channels import channel_plan
    from cadence.pipeline.schedule.generators import generate
    from cadence.pipeline.schedule.ir import Action, ActionKind, Schedule, ScheduleValidationError
    from cadence.pipeline.schedule.passes import lower
    from cadence.pipeline.schedule.sim import simulate, verify

__all__ = [
    "Action",
    "ActionKind",
    "PipelineRuntime",
    "PipelineStage",
    "Schedule",
    "ScheduleValidationError",
    "build_pipeline",
    "channel_plan",
    "generate",
    "lower",
    "simulate",
    "verify",
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
