"""Data-parallel actions of a lowered schedule: gradient reductions and parameter residency.

[Note: deferred gradient reduction]
A stage's gradients are final after its last B or W of the step, so REDUCE_GRAD
(issue the data-parallel reduction, asynchronously) goes right after it, while the
other local stages still compute. Its WAIT_REDUCE_GRAD is deferred: a rank keeps
up to K reductions in flight (``max_outstanding``, default 1) and waits for the
oldest just before it issues one more, and for the rest at the end of its list.
K bounds the memory of reduction buffers; each wait is as late as K allows, so
each reduction overlaps the compute that follows it.

[Note: unshard and reshard placement]
For a sharded stage (fully_shard) the parameters must be gathered before the
stage computes and may be freed after its last use. `add_unshard_reshard` makes
this part of the timeline: UNSHARD(stage) goes ``lookahead`` compute actions
before the stage's first compute on its rank (so the all-gather overlaps them;
0 puts it right before), RESHARD(stage) right after the stage's last compute, or
after its REDUCE_GRAD when that follows (the reduction reads the unsharded
gradients). Between the two the parameters stay resident: one all-gather per
stage per step, instead of one per forward and per backward. The simulator
charges a resident stage's parameters to its rank's memory, so the peak it
reports is parameters plus activations; a larger lookahead trades memory for
overlap.

A schedule for an accumulation step (``lower(..., reduce_grad=False)``) has no
reduction to issue or wait for; whether such a step keeps the parameters gathered
across steps is the runtime's choice, since it spans several schedules.
"""

from __future__ import annotations

from cadence.pipeline.schedule._errors import ScheduleValidationError
from cadence.pipeline.schedule.ir import Action, ActionKind, Schedule

__all__ = ["add_reduce_grad", "add_unshard_reshard", "add_wait_reduce"]

_REDUCTIONS = (ActionKind.REDUCE_GRAD, ActionKind.WAIT_REDUCE_GRAD)


def add_reduce_grad(sched: Schedule) -> Schedule:
    """REDUCE_GRAD(stage) right after the stage's last B or W on its rank.

    Reductions already in the list (torch's compute CSVs carry REDUCE_GRAD) are
    dropped first: placing them is this pass's job. See [Note: deferred gradient
    reduction].
    """
    out = []
    for row in sched.ranks:
        acts = [a for a in row if a.kind not in _REDUCTIONS]
        last: dict[int, int] = {}
        for i, a in enumerate(acts):
            for c in a.compute_parts():
                if c.kind in (ActionKind.B, ActionKind.W):
                    last[c.stage] = i
        new: list[Action] = []
        for i, a in enumerate(acts):
            new.append(a)
            new.extend(Action(ActionKind.REDUCE_GRAD, s) for s in sorted(last) if last[s] == i)
        out.append(new)
    return sched.with_ranks(out)


def add_wait_reduce(sched: Schedule, *, max_outstanding: int = 1) -> Schedule:
    """WAIT_REDUCE_GRAD(stage), at most ``max_outstanding`` reductions in flight per rank.

    See [Note: deferred gradient reduction].
    """
    if not isinstance(max_outstanding, int) or max_outstanding < 1:
        raise ScheduleValidationError(
            f"max_outstanding must be an int >= 1 (reductions in flight per rank), got "
            f"{max_outstanding!r}"
        )
    out = []
    for acts in sched.ranks:
        new: list[Action] = []
        pending: list[int] = []
        for a in acts:
            if a.kind is ActionKind.WAIT_REDUCE_GRAD:
                raise ScheduleValidationError(
                    f"{a}: the schedule already has its waits; add_wait_reduce places them"
                )
            if a.kind is ActionKind.REDUCE_GRAD:
                if len(pending) == max_outstanding:
                    new.append(Action(ActionKind.WAIT_REDUCE_GRAD, pending.pop(0)))
                pending.append(a.stage)
            new.append(a)
        new += [Action(ActionKind.WAIT_REDUCE_GRAD, s) for s in pending]
        out.append(new)
    return sched.with_ranks(out)


def add_unshard_reshard(sched: Schedule, *, lookahead: int = 1) -> Schedule:
    """UNSHARD / RESHARD per stage; see [Note: unshard and reshard placement]."""
    if not isinstance(lookahead, int) or lookahead < 0:
        raise ScheduleValidationError(
            f"lookahead must be an int >= 0 (compute actions of prefetch), got {lookahead!r}"
        )
    out = []
    for r, acts in enumerate(sched.ranks):
        if any(a.kind in (ActionKind.UNSHARD, ActionKind.RESHARD) for a in acts):
            raise ScheduleValidationError(
                f"rank {r} already has UNSHARD/RESHARD actions; add_unshard_reshard places them"
            )
        computes = [i for i, a in enumerate(acts) if a.is_compute]
        first: dict[int, int] = {}  # stage -> index of its first compute
        last: dict[int, int] = {}
        for i in computes:
            for c in acts[i].compute_parts():
                first.setdefault(c.stage, i)
                last[c.stage] = i
        rank_of_compute = {i: k for k, i in enumerate(computes)}  # index -> k-th compute
        before: dict[int, list[int]] = {}  # action index -> stages to unshard before it
        for s, i in first.items():
            k = rank_of_compute[i]
            before.setdefault(computes[max(0, k - lookahead)], []).append(s)
        after: dict[int, list[int]] = {}
        for s, i in last.items():
            j = i
            # Past this stage's REDUCE_GRAD if it follows (with other markers between).
            while j + 1 < len(acts) and not acts[j + 1].is_compute:
                j += 1
                if acts[j].kind is ActionKind.REDUCE_GRAD and acts[j].stage == s:
                    break
            else:
                j = i
            after.setdefault(j, []).append(s)
        new: list[Action] = []
        for i, a in enumerate(acts):
            new += [Action(ActionKind.UNSHARD, s) for s in sorted(before.get(i, ()))]
            new.append(a)
            new += [Action(ActionKind.RESHARD, s) for s in sorted(after.get(i, ()))]
        out.append(new)
    return sched.with_ranks(out)
