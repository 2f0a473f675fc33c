"""Pipeline parallelism: schedules as data, derived P2P channels, a simulator.

The schedule layer (no process group needed): `ir` (Action, Schedule), `generators`,
`passes` (validation, lowering), `topology` (channels, plan, digest), `sim`
(simulator, `verify`), `viz` and `cli`. The runtime (stage, executor, groups) lives
in ``runtime.py``/``stage.py``/``groups.py`` and is imported from there.
"""

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
from cadence.pipeline.passes import (
    add_comms,
    add_reduce_grad,
    add_wait_reduce,
    apply_parity_rule,
    lower,
    validate_compute,
    validate_lowered,
)
from cadence.pipeline.sim import (
    FifoMismatchError,
    ScheduleDeadlockError,
    SimResult,
    TimeModel,
    chrome_trace,
    simulate,
    verify,
)
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
    "Action",
    "ActionKind",
    "ChannelPlan",
    "FifoMismatchError",
    "Payload",
    "Schedule",
    "ScheduleDeadlockError",
    "ScheduleMeta",
    "ScheduleValidationError",
    "SimResult",
    "TimeModel",
    "add_comms",
    "add_reduce_grad",
    "add_wait_reduce",
    "apply_parity_rule",
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
    "one_f_one_b",
    "parse_action",
    "plan_rounds",
    "simulate",
    "v_placement",
    "validate_compute",
    "validate_lowered",
    "verify",
    "zb_h1",
    "zbv",
]
