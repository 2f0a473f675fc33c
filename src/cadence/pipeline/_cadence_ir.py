"""Adapter from the schedule layer (IR, passes, simulator, plan) to the runtime.

`lower_named` / `lower_schedule` return what ``_build.build_pipeline`` hands to
``PipelineRuntime``: per-rank `Op` lists, the placement, and extra keyword
arguments (the canonical channels and creation rounds). Both verify the lowered
schedule with the simulator first: the runtime never sees a schedule that fails it.
"""

from __future__ import annotations

from typing import Any

from cadence.pipeline._ops import Op, from_action
from cadence.pipeline.generators import generate
from cadence.pipeline.ir import Schedule
from cadence.pipeline.passes import lower
from cadence.pipeline.sim import verify
from cadence.pipeline.topology import channel_plan

__all__ = ["lower_named", "lower_schedule"]


def lower_named(name: str, pp: int, chunks: int, m: int) -> tuple[dict[int, list[Op]], dict[int, int], dict[str, Any]]:
    """Generate, lower, verify and adapt a named schedule."""
    return lower_schedule(generate(name, pp, m, chunks))


def lower_schedule(schedule: Schedule) -> tuple[dict[int, list[Op]], dict[int, int], dict[str, Any]]:
    """Lower (if compute-only), verify and adapt a cadence `Schedule`."""
    low = schedule if schedule.meta.lowered else lower(schedule)
    verify(low)
    placement = {s: r for s, r in enumerate(low.placement)}
    ops = {r: [from_action(a, placement) for a in acts] for r, acts in enumerate(low.ranks)}
    plan = channel_plan(low)
    extra = {"channels": list(plan.edges), "rounds": [list(rd) for rd in plan.rounds]}
    return ops, placement, extra
