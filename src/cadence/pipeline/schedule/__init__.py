"""The schedule layer: pipeline schedules as data, with no process group and no torch.

Modules, each importing only those before it:

- ``ir``: `Action`, `ActionKind`, `Payload`, `Schedule` (placement + per-rank
  action lists), text/JSON/CSV forms compatible with torch's action strings.
- ``validate``: the compute and lowered rules, and the dataflow they are stated in.
- ``orders``: placements, microbatch groups, the depth-first order, `replay`.
- ``greedy`` / ``zero_bubble``: ZB-H1, ZBV, DualPipeV.
- ``generators``: GPipe, 1F1B, Interleaved 1F1B, LoopedBFS and the registry.
- ``sim``: the discrete-event simulator, `verify` (the runtime's gate) and
  `repair_deadlocks`.
- ``dp_passes``: REDUCE_GRAD with deferred waits (<= K in flight), UNSHARD /
  RESHARD placement.
- ``passes``: lowering (comms in one global message order, then ``dp_passes``)
  and `complete_comms` for schedules lowered by torch pipelining.
- ``channels``: the directed P2P channels of a lowered schedule, their creation
  plan and its digest (the one value every rank votes on).
- ``viz``: ASCII grid, PNG and Chrome trace of a simulation.
- ``show``: what ``cadence schedule show`` prints.
- ``compare``: what ``cadence schedule compare`` prints (torch's generators
  against cadence's; imports torch only when it compares).

Everything here is deterministic and runs where torch is not installed.
"""

from __future__ import annotations

from cadence.pipeline.schedule._errors import ScheduleValidationError
from cadence.pipeline.schedule.channels import (
    CHANNEL_MODES,
    ChannelPlan,
    channel_plan,
    derive_channels,
    describe_plan_difference,
    logical_edges,
    plan_rounds,
)
from cadence.pipeline.schedule.compare import (
    CompareRow,
    OrderMetrics,
    compare,
    format_table,
    order_metrics,
    torch_order,
)
from cadence.pipeline.schedule.dp_passes import (
    add_reduce_grad,
    add_unshard_reshard,
    add_wait_reduce,
)
from cadence.pipeline.schedule.generators import (
    GENERATORS,
    SCHEDULE_NAMES,
    canonical_name,
    default_chunks,
    dualpipev,
    generate,
    gpipe,
    interleaved_1f1b,
    loop_placement,
    looped_bfs,
    one_f_one_b,
    placement_for,
    torch_schedule_name,
    v_placement,
    zb_h1,
    zbv,
)
from cadence.pipeline.schedule.ir import (
    IR_VERSION,
    Action,
    ActionKind,
    Payload,
    Schedule,
    ScheduleMeta,
    parse_action,
)
from cadence.pipeline.schedule.orders import microbatch_groups, replay
from cadence.pipeline.schedule.passes import (
    add_comms,
    apply_parity_rule,
    complete_comms,
    lower,
    order_comms,
)
from cadence.pipeline.schedule.show import show_schedule
from cadence.pipeline.schedule.sim import (
    FifoMismatchError,
    MemoryModel,
    ScheduleDeadlockError,
    SimResult,
    TimeModel,
    repair_deadlocks,
    simulate,
    verify,
)
from cadence.pipeline.schedule.validate import (
    inputs_of,
    outputs_of,
    validate_compute,
    validate_lowered,
    validate_reductions,
    validate_residency,
)
from cadence.pipeline.schedule.viz import ascii_grid, chrome_trace, render_png

__all__ = [
    "CHANNEL_MODES",
    "GENERATORS",
    "IR_VERSION",
    "SCHEDULE_NAMES",
    "Action",
    "ActionKind",
    "ChannelPlan",
    "CompareRow",
    "FifoMismatchError",
    "MemoryModel",
    "OrderMetrics",
    "Payload",
    "Schedule",
    "ScheduleDeadlockError",
    "ScheduleMeta",
    "ScheduleValidationError",
    "SimResult",
    "TimeModel",
    "add_comms",
    "add_reduce_grad",
    "add_unshard_reshard",
    "add_wait_reduce",
    "apply_parity_rule",
    "ascii_grid",
    "canonical_name",
    "channel_plan",
    "chrome_trace",
    "compare",
    "complete_comms",
    "default_chunks",
    "derive_channels",
    "describe_plan_difference",
    "dualpipev",
    "format_table",
    "generate",
    "gpipe",
    "inputs_of",
    "interleaved_1f1b",
    "logical_edges",
    "loop_placement",
    "looped_bfs",
    "lower",
    "microbatch_groups",
    "one_f_one_b",
    "order_comms",
    "order_metrics",
    "outputs_of",
    "parse_action",
    "placement_for",
    "plan_rounds",
    "render_png",
    "repair_deadlocks",
    "replay",
    "show_schedule",
    "simulate",
    "torch_order",
    "torch_schedule_name",
    "v_placement",
    "validate_compute",
    "validate_lowered",
    "validate_reductions",
    "validate_residency",
    "verify",
    "zb_h1",
    "zbv",
]
