"""Pipeline parallelism: schedules as data, derived P2P channels, a simulator.

The schedule layer (no process group needed): `ir` (Action, Schedule), `generators`,
`passes` (validation, lowering), `topology` (channels, plan, digest), `sim`
(simulator, `verify`), `viz` and `cli`. The runtime: `stage` (PipelineStage), `runtime`
(executor), `groups` (channels -> process groups), `dp` (deferred reduction waits),
and `build_pipeline`, the one-call entry point.
"""

from cadence.pipeline._build import SCHEDULE_NAMES, build_pipeline, placement_for
from cadence.pipeline.dp import StageGradSync
from cadence.pipeline.generators import (
    GENERATORS,
    dualpipev,
    generate,
    gpipe,
    interleaved_1f1b,
    loop_placement,
    looped_bfs,
    one_f_one_b,
    v_placement,
    zb_h1,
    zbv,
)
from cadence.pipeline.groups import ChannelGroups, PlanMismatchError, build_channel_groups
from cadence.pipeline.ir import (
    IR_VERSION,
    Action,
    ActionKind,
    Payload,
    Schedule,
    ScheduleMeta,
    ScheduleValidationError,
    parse_action,
)
from cadence.pipeline.microbatch import LossPolicy, merge_microbatches, split_microbatches
from cadence.pipeline.passes import (
    add_comms,
    add_reduce_grad,
    add_wait_reduce,
    apply_parity_rule,
    lower,
    validate_compute,
    validate_lowered,
)
from cadence.pipeline.runtime import PipelineRuntime, PipelineRuntimeError
from cadence.pipeline.sim import (
    FifoMismatchError,
    ScheduleDeadlockError,
    SimResult,
    TimeModel,
    chrome_trace,
    simulate,
    verify,
)
from cadence.pipeline.stage import PipelineStage, StageShapeError, TensorMeta
from cadence.pipeline.topology import (
    ChannelPlan,
    channel_plan,
    derive_channels,
    describe_plan_difference,
    plan_rounds,
)

__all__ = [
    "GENERATORS",
    "IR_VERSION",
    "SCHEDULE_NAMES",
    "Action",
    "ActionKind",
    "ChannelGroups",
    "ChannelPlan",
    "FifoMismatchError",
    "LossPolicy",
    "Payload",
    "PipelineRuntime",
    "PipelineRuntimeError",
    "PipelineStage",
    "PlanMismatchError",
    "Schedule",
    "ScheduleDeadlockError",
    "ScheduleMeta",
    "ScheduleValidationError",
    "SimResult",
    "StageGradSync",
    "StageShapeError",
    "TensorMeta",
    "TimeModel",
    "add_comms",
    "add_reduce_grad",
    "add_wait_reduce",
    "apply_parity_rule",
    "build_channel_groups",
    "build_pipeline",
    "channel_plan",
    "chrome_trace",
    "derive_channels",
    "describe_plan_difference",
    "dualpipev",
    "generate",
    "gpipe",
    "interleaved_1f1b",
    "loop_placement",
    "looped_bfs",
    "lower",
    "merge_microbatches",
    "one_f_one_b",
    "parse_action",
    "placement_for",
    "plan_rounds",
    "simulate",
    "split_microbatches",
    "v_placement",
    "validate_compute",
    "validate_lowered",
    "verify",
    "zb_h1",
    "zbv",
]
