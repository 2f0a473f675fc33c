"""Adapter from the schedule layer (ir / generators / passes / topology / sim) to the runtime.

Everything the runtime needs from the schedule layer goes through this file, so
that a change of spelling there is one edit here:

- ``lower_named(name, p, v, m)``: generate, lower, verify -> (ops, placement, extra)
- ``lower_schedule(schedule)``: the same for a user's ``Schedule`` (compute-only or lowered)
- ``simulated_bubble(name, p, v, m)``: the simulator's bubble at equal durations

``extra`` carries the schedule layer's channel plan (channels, rounds, digest) to
`PipelineRuntime`, so groups are built from *its* canonical plan.
"""

from __future__ import annotations

from typing import Any

from cadence.pipeline import ir
from cadence.pipeline._ops import Op, from_action

__all__ = ["available", "lower_named", "lower_schedule", "simulated_bubble", "to_ops"]


def to_ops(schedule: ir.Schedule) -> tuple[dict[int, list[Op]], dict[int, int]]:
    """A lowered ``Schedule`` -> per-rank `Op` lists and a placement dict."""
    placement = dict(enumerate(schedule.placement))
    ops = {r: [from_action(a, placement) for a in acts] for r, acts in enumerate(schedule.ranks)}
    return ops, placement


def _sim() -> Any | None:
    try:
        from cadence.pipeline import sim
    except ImportError:  # the simulator lands separately; see available()
        return None
    return sim


def _topology() -> Any | None:
    try:
        from cadence.pipeline import topology
    except ImportError:
        return None
    return topology


def available() -> bool:
    """True when the schedule layer's generators and passes are importable."""
    try:
        from cadence.pipeline import generators, passes  # noqa: F401
    except ImportError:
        return False
    return True


def _finish(low: ir.Schedule) -> tuple[dict[int, list[Op]], dict[int, int], dict[str, Any]]:
    sim = _sim()
    if sim is not None:
        # The runtime refuses a schedule that fails the simulator (design §5.1 item 5):
        # verify raises on a deadlock or a FIFO mismatch, before any group exists.
        sim.verify(low)
    ops, placement = to_ops(low)
    extra: dict[str, Any] = {}
    topo = _topology()
    plan_fn = getattr(topo, "derive_channels", None) if topo is not None else None
    if plan_fn is not None:
        plan = plan_fn(low)
        channels = [tuple(c) for c in getattr(plan, "edges", ())]
        rounds = getattr(plan, "rounds", None)
        if channels:
            extra["channels"] = channels
        if rounds is not None:
            extra["rounds"] = [[tuple(c) for c in r] for r in rounds]
    return ops, placement, extra


def lower_named(name: str, p: int, v: int, m: int):
    """Generate ``name`` for p ranks, v chunks, m microbatches; lower and verify it."""
    from cadence.pipeline import generators, passes

    sched = generators.generate(name, p, m, v)
    return _finish(passes.lower(sched, repair=_sim() is not None))


def lower_schedule(schedule: ir.Schedule):
    """A user's ``Schedule``: lowered if it is compute-only, then verified."""
    from cadence.pipeline import passes

    low = schedule
    if not schedule.meta.lowered:
        low = passes.lower(schedule, repair=_sim() is not None)
    else:
        passes.validate_lowered(low)
    return _finish(low)


def simulated_bubble(name: str, p: int, v: int, m: int) -> float | None:
    """The simulator's bubble fraction at equal durations, if it exposes one."""
    sim = _sim()
    if sim is None:
        return None
    from cadence.pipeline import generators, passes

    low = passes.lower(generators.generate(name, p, m, v))
    for fn_name in ("simulate", "run"):
        fn = getattr(sim, fn_name, None)
        if fn is not None:
            result = fn(low)
            for attr in ("bubble", "bubble_fraction"):
                if hasattr(result, attr):
                    return float(getattr(result, attr))
    return None
