"""From a schedule name (or a cadence ``Schedule``) and stage modules to a runtime.

``build_pipeline`` is the one-call entry point: generate the schedule with the
schedule layer's generator, lower it (SEND/RECV with per-channel sequence
numbers, LOCAL hand-offs, REDUCE_GRAD/WAIT_REDUCE_GRAD) and hand the lowered
`Schedule` to `PipelineRuntime`, which verifies it with the simulator, votes on
its plan digest and runs it. What runs is exactly the generated IR; no schedule
is re-implemented here.

``source="torch"`` instead takes torch pipelining's own lowered lists for the same
schedule (``get_schedule_ops(..., with_comms=True)``), parses them into the cadence
IR (`Schedule.from_lists` reads torch's action strings; `complete_comms` adds the
channels, sequence numbers and LOCAL hand-offs torch leaves implicit) and runs
that under the same gate and executor: an interop path and a like-for-like
benchmark baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from cadence.comm import EventLog
from cadence.pipeline.runtime.errors import PipelineUsageError
from cadence.pipeline.runtime.executor import PipelineRuntime
from cadence.pipeline.runtime.groups import ChannelMode
from cadence.pipeline.runtime.stage import Stage, TensorMeta
from cadence.pipeline.schedule.generators import (
    canonical_name,
    generate,
    placement_for,
    torch_schedule_name,
)
from cadence.pipeline.schedule.ir import Schedule
from cadence.pipeline.schedule.passes import complete_comms, lower
from cadence.topology import ParallelGroups

__all__ = ["build_pipeline", "torch_lowered_schedule"]


def build_pipeline(
    schedule: str | Schedule,
    stage_modules: Sequence[nn.Module] | Mapping[int, nn.Module],
    *,
    n_microbatches: int | None = None,
    chunks: int | None = None,
    groups: ParallelGroups | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    loss_reduction: str = "mean",
    event_log: EventLog | None = None,
    channel_mode: ChannelMode = "per_directed_edge",
    input_meta: Mapping[int, TensorMeta | Sequence[TensorMeta]] | None = None,
    source: Literal["cadence", "torch"] = "cadence",
    device: torch.device | str | None = None,
    max_outstanding_reductions: int = 1,
    unshard_lookahead: int | None = None,
    tied_parameters: Sequence[Sequence[tuple[int, str]]] = (),
    batch_p2p: bool = False,
    recv_lookahead: int | None = None,
) -> PipelineRuntime:
    """Build this rank's pipeline runtime. Collective over the world (channel groups).

    Args:
        schedule: a generator name (``SCHEDULE_NAMES`` or an alias), or a cadence
            ``Schedule`` (compute-only or lowered).
        stage_modules: every stage's module in stage order (each rank keeps its own),
            or ``{stage: module}`` with only this rank's stages.
        n_microbatches: microbatches per step; required with a name. With a
            ``Schedule`` it may be omitted, and must equal the schedule's if given.
        chunks: stages per rank (v); default 1 with a name. With a ``Schedule`` it
            may be omitted, and must equal the schedule's if given.
        groups: ``cadence.init(...)``'s result; default: the world is one pipeline.
        loss_fn, loss_reduction, event_log, channel_mode: see `PipelineRuntime`.
        input_meta: static per-stage input metadata; default inferred at step 1.
        source: ``"cadence"`` (the schedule layer's IR) or ``"torch"`` (torch's
            lowered IR for the same schedule name, parsed into cadence's).
        device: where stages run; default ``groups.device`` (CPU without groups).
        max_outstanding_reductions: data-parallel reductions in flight per rank
            (K): lowering waits the oldest when a (K+1)-th is issued, the rest at
            the end of the step. Only where this call lowers the schedule.
        unshard_lookahead: L >= 0 puts each stage's parameter all-gather on the
            timeline: lowering adds UNSHARD L compute actions before the stage's
            first compute on its rank and RESHARD after its last (or after its
            REDUCE_GRAD), and the runtime keeps the stage gathered in between (one
            all-gather per unit per step instead of one per forward and backward;
            see [Note: unshard and reshard placement] in ``schedule/dp_passes.py``).
            ``None`` (default) leaves gathering to the stage wrappers. Only where
            this call lowers the schedule; stages without ``unshard`` (plain or
            DataParallel) ignore the actions.
        tied_parameters: parameters shared by several stages; see `PipelineRuntime`.
        batch_p2p: batch consecutive sends/receives; see `PipelineRuntime`.
        recv_lookahead: receives posted ahead per channel; see `PipelineRuntime`.
    """
    pp_ranks = list(groups.pp_ranks) if groups is not None else list(range(dist.get_world_size()))
    pp = len(pp_ranks)
    low = _lowered(
        schedule, pp, n_microbatches, chunks, source, max_outstanding_reductions, unshard_lookahead
    )
    mine = low.stages_of(pp_ranks.index(dist.get_rank()))
    dev = _stage_device(device, groups)
    modules = _local_modules(stage_modules, mine, low.num_stages, pp)
    _check_input_meta(input_meta, low.num_stages)
    stages = [
        Stage(modules[s], s, low.num_stages, device=dev, input_meta=(input_meta or {}).get(s))
        for s in mine
    ]
    return PipelineRuntime(
        low,
        stages,
        loss_fn=loss_fn,
        groups=groups,
        loss_reduction=loss_reduction,
        channel_mode=channel_mode,
        event_log=event_log,
        tied_parameters=tied_parameters,
        batch_p2p=batch_p2p,
        recv_lookahead=recv_lookahead,
    )


def _stage_device(device: torch.device | str | None, groups: ParallelGroups | None) -> torch.device:
    """Where this rank's stages run: the caller's device, else the groups', else the CPU."""
    if device is not None:
        return torch.device(device)
    return groups.device if groups is not None else torch.device("cpu")


def _local_modules(
    stage_modules: Sequence[nn.Module] | Mapping[int, nn.Module],
    mine: Sequence[int],
    num_stages: int,
    pp: int,
) -> dict[int, nn.Module]:
    """This rank's stage modules, checked against the placement before any stage is built."""
    if isinstance(stage_modules, Mapping):
        modules = dict(stage_modules)
        missing = [s for s in mine if s not in modules]
        if missing:
            raise PipelineUsageError(
                f"stage_modules has no module for stages {missing}, which the schedule "
                f"places on this rank (it places {list(mine)} here)"
            )
        return modules
    if len(stage_modules) != num_stages:
        raise PipelineUsageError(
            f"got {len(stage_modules)} stage modules, the schedule has "
            f"{num_stages} stages ({pp} ranks x {num_stages // pp} chunks)"
        )
    return {s: stage_modules[s] for s in mine}


def _check_input_meta(
    input_meta: Mapping[int, TensorMeta | Sequence[TensorMeta]] | None, num_stages: int
) -> None:
    """Static metadata may name only stages the schedule has: a typo would be ignored."""
    unknown = sorted(set(input_meta or {}) - set(range(num_stages)))
    if unknown:
        raise PipelineUsageError(
            f"input_meta names stages {unknown}, the schedule has 0..{num_stages - 1}"
        )


def _lowered(
    schedule: str | Schedule,
    pp: int,
    n_microbatches: int | None,
    chunks: int | None,
    source: str,
    k: int,
    lookahead: int | None,
) -> Schedule:
    """The lowered schedule to run, after checking every argument against it."""
    if source not in ("cadence", "torch"):
        raise PipelineUsageError(f"source={source!r}; use 'cadence' or 'torch'")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise PipelineUsageError(f"max_outstanding_reductions={k!r}; use an int >= 1")
    if lookahead is not None and (
        not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0
    ):
        raise PipelineUsageError(
            f"unshard_lookahead={lookahead!r}; use an int >= 0 (compute actions of "
            "prefetch before a stage's first compute) or None (gather on demand)"
        )
    prelowered = source == "torch" or (isinstance(schedule, Schedule) and schedule.meta.lowered)
    if k != 1 and prelowered:
        raise PipelineUsageError(
            f"max_outstanding_reductions={k} places WAIT_REDUCE_GRAD while lowering, but "
            "this schedule arrives lowered; lower it yourself with "
            "lower(schedule, max_outstanding_reductions=...) or pass a compute-only schedule"
        )
    if lookahead is not None and prelowered:
        raise PipelineUsageError(
            f"unshard_lookahead={lookahead} places UNSHARD/RESHARD while lowering, but this "
            "schedule arrives lowered; lower it yourself with "
            "lower(schedule, unshard_lookahead=...) or pass a compute-only schedule"
        )
    if isinstance(schedule, str):
        if n_microbatches is None:
            raise PipelineUsageError("build_pipeline(name, ...) needs n_microbatches=")
        v = 1 if chunks is None else chunks
        if source == "torch":
            return torch_lowered_schedule(schedule, pp, n_microbatches, v)
        compute = generate(canonical_name(schedule), pp, n_microbatches, v)
        return lower(compute, max_outstanding_reductions=k, unshard_lookahead=lookahead)
    if not isinstance(schedule, Schedule):
        raise PipelineUsageError(
            f"schedule must be a name or a cadence Schedule, got {type(schedule).__name__}"
        )
    if source != "cadence":
        raise PipelineUsageError(
            "source='torch' selects torch's IR for a schedule *name*; a Schedule is "
            "already cadence IR (for torch's lowered lists use Schedule.from_lists and "
            "complete_comms)"
        )
    v = schedule.num_stages // max(1, schedule.num_ranks)
    if n_microbatches is not None and n_microbatches != schedule.meta.m:
        raise PipelineUsageError(
            f"n_microbatches={n_microbatches} but the schedule has {schedule.meta.m} "
            "microbatches; omit n_microbatches or pass the schedule's"
        )
    if chunks is not None and chunks != v:
        raise PipelineUsageError(
            f"chunks={chunks} but the schedule has {v} stages per rank; omit chunks "
            "or pass the schedule's"
        )
    if schedule.meta.lowered:
        return schedule
    return lower(schedule, max_outstanding_reductions=k, unshard_lookahead=lookahead)


def torch_lowered_schedule(name: str, pp: int, n_microbatches: int, chunks: int) -> Schedule:
    """torch pipelining's lowered IR for a named schedule, as a lowered cadence `Schedule`.

    Only multi-stage schedules have one: torch runs GPipe and 1F1B as hand-written
    loops, and the IR it keeps beside them is a picture, not what runs (see [Note:
    the generated IR is what runs] in ``schedule/generators.py``).
    """
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    key = canonical_name(name)
    if key in ("gpipe", "1f1b"):
        raise PipelineUsageError(
            f"source='torch' has no executable IR for {name}: torch runs it as a "
            "hand-written loop. Use source='cadence'."
        )
    placement = placement_for(key, pp, chunks)
    ops = get_schedule_ops(torch_schedule_name(key), pp, n_microbatches, chunks, with_comms=True)
    rows = {r: [str(a) for a in ops[r] if a is not None] for r in range(pp)}
    sched = Schedule.from_lists(
        rows, placement, generator=f"torch:{key}", v=chunks, m=n_microbatches, lowered=True
    )
    return complete_comms(sched)
