"""Adapter from the schedule layer (IR, passes, simulator, plan) to the runtime.

`lower_named` / `lower_schedule` return what ``_build.build_pipeline`` hands to
``PipelineRuntime``: per-rank `Op` lists, the placement, and extra keyword
arguments (the canonical channels and creation rounds of ``topology.channel_plan``).
Both verify the lowered schedule with the simulator first, in the channel mode the
runtime will use: the runtime never sees a schedule that fails it. Every rank
verifies the same global schedule, so a bad schedule raises on every rank, before
any process group exists.
"""

from __future__ import annotations

from typing import Any

from cadence.pipeline._ops import Op, from_action
from cadence.pipeline.generators import generate
from cadence.pipeline.ir import Schedule
from cadence.pipeline.passes import lower, validate_lowered
from cadence.pipeline.sim import simulate, verify
from cadence.pipeline.topology import channel_plan

__all__ = ["available", "lower_named", "lower_schedule", "simulated_bubble", "to_ops"]

Lowered = tuple[dict[int, list[Op]], dict[int, int], dict[str, Any]]


def available() -> bool:
    """True: the schedule layer imported (this module imports it at the top)."""
    return True


def to_ops(low: Schedule) -> tuple[dict[int, list[Op]], dict[int, int]]:
    """A lowered `Schedule` -> per-rank `Op` lists and a placement dict."""
    placement = dict(enumerate(low.placement))
    ops = {r: [from_action(a, placement) for a in acts] for r, acts in enumerate(low.ranks)}
    return ops, placement


def lower_named(
    name: str, pp: int, chunks: int, m: int, mode: str = "per_directed_edge"
) -> Lowered:
    """Generate, lower, verify and adapt a named schedule."""
    return lower_schedule(generate(name, pp, m, chunks), mode)


def lower_schedule(schedule: Schedule, mode: str = "per_directed_edge") -> Lowered:
    """Lower (if compute-only), verify and adapt a cadence `Schedule`."""
    if schedule.meta.lowered:
        low = schedule
        validate_lowered(low)
    else:
        low = lower(schedule)
    # "shared" in the runtime is one communicator for everything: verify it as such.
    verify(low, mode=mode)  # type: ignore[arg-type]
    ops, placement = to_ops(low)
    plan = channel_plan(low)
    extra = {"channels": list(plan.edges), "rounds": [list(rd) for rd in plan.rounds]}
    return ops, placement, extra


def simulated_bubble(name: str, p: int, v: int, m: int) -> float:
    """The simulator's bubble (idle / (p x makespan)) at equal F = I = W durations."""
    return float(simulate(lower(generate(name, p, m, v))).bubble)
