"""From a schedule name (or a cadence ``Schedule``) and stage modules to a runtime.

``build_pipeline`` is the one-call entry point: generate the schedule with the
schedule layer's generator, lower it (SEND/RECV with per-channel sequence
numbers, LOCAL hand-offs, REDUCE_GRAD/WAIT_REDUCE_GRAD), verify it with the
simulator, derive its channels, and hand the *lowered IR* to `PipelineRuntime`.
What runs is exactly the generated IR; no schedule is re-implemented here.

``source="torch"`` instead takes torch pipelining's own lowered IR for the same
schedule (``get_schedule_ops(..., with_comms=True)``) and runs it under cadence's
executor and channels: an interop path and a like-for-like benchmark baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from cadence.comm import EventLog
from cadence.pipeline._ops import from_torch_actions
from cadence.pipeline.generators import canonical_name
from cadence.pipeline.groups import ChannelMode
from cadence.pipeline.runtime import PipelineRuntime
from cadence.pipeline.stage import PipelineStage, TensorMeta
from cadence.topology import ParallelGroups

__all__ = ["SCHEDULE_NAMES", "build_pipeline", "placement_for", "torch_schedule_name"]

# Canonical cadence names -> torch pipelining names (for source="torch" and parity tests).
_TORCH_NAMES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "zb_h1": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
SCHEDULE_NAMES = tuple(_TORCH_NAMES)
_V_SHAPED = {"zbv", "dualpipev"}


def torch_schedule_name(name: str) -> str:
    return _TORCH_NAMES[canonical_name(name)]


def placement_for(name: str, pp: int, chunks: int) -> dict[int, int]:
    """stage -> pipeline rank: loop (``s % pp``) or V (0..p-1, p-1..0) for V schedules."""
    n = pp * chunks
    if canonical_name(name) in _V_SHAPED:
        if chunks != 2:
            raise ValueError(f"{name} is V-shaped and needs chunks=2, got {chunks}")
        return {s: (s if s < pp else 2 * pp - 1 - s) for s in range(n)}
    return {s: s % pp for s in range(n)}


def build_pipeline(
    schedule: str | Any,
    stage_modules: Sequence[nn.Module] | Mapping[int, nn.Module],
    *,
    n_microbatches: int,
    chunks: int = 1,
    groups: ParallelGroups | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    loss_reduction: str = "mean",
    event_log: EventLog | None = None,
    channel_mode: ChannelMode = "per_directed_edge",
    input_meta: Mapping[int, TensorMeta | Sequence[TensorMeta]] | None = None,
    source: Literal["cadence", "torch"] = "cadence",
    device: torch.device | str | None = None,
) -> PipelineRuntime:
    """Build this rank's pipeline runtime. Collective over the world (channel groups).

    Args:
        schedule: a generator name (``SCHEDULE_NAMES`` or an alias), or a cadence
            ``Schedule`` (compute-only or lowered).
        stage_modules: every stage's module in stage order (each rank keeps its own),
            or ``{stage: module}`` with only this rank's stages.
        n_microbatches: microbatches per step.
        chunks: stages per rank (v).
        groups: ``cadence.init(...)``'s result; default: the world is one pipeline.
        loss_fn, loss_reduction, event_log, channel_mode: see `PipelineRuntime`.
        input_meta: static per-stage input metadata; default inferred at step 1.
        source: ``"cadence"`` (the schedule layer's IR) or ``"torch"`` (torch's IR).
    """
    pp_ranks = list(groups.pp_ranks) if groups is not None else list(range(dist.get_world_size()))
    pp = len(pp_ranks)
    pp_rank = pp_ranks.index(dist.get_rank())
    if isinstance(schedule, str):
        if source == "torch":
            ops, placement = _torch_ops(schedule, pp, chunks, n_microbatches)
            implicit_local = True
            extra: dict[str, Any] = {}
        else:
            from cadence.pipeline import _cadence_ir

            ops, placement, extra = _cadence_ir.lower_named(
                canonical_name(schedule), pp, chunks, n_microbatches, channel_mode
            )
            implicit_local = False
    else:
        from cadence.pipeline import _cadence_ir

        ops, placement, extra = _cadence_ir.lower_schedule(schedule, channel_mode)
        implicit_local = False
    mine = sorted(s for s, r in placement.items() if r == pp_rank)
    dev = torch.device(device) if device is not None else (groups.device if groups else "cpu")
    if isinstance(stage_modules, Mapping):
        modules = dict(stage_modules)
    else:
        if len(stage_modules) != len(placement):
            raise ValueError(
                f"got {len(stage_modules)} stage modules, the schedule has "
                f"{len(placement)} stages ({pp} ranks x {chunks} chunks)"
            )
        modules = {s: stage_modules[s] for s in mine}
    stages = [
        PipelineStage(
            modules[s],
            s,
            len(placement),
            device=dev,
            input_meta=(input_meta or {}).get(s),
        )
        for s in mine
    ]
    return PipelineRuntime(
        ops,
        placement,
        n_microbatches,
        stages,
        loss_fn=loss_fn,
        pp_ranks=pp_ranks,
        pp_group=groups.pp if groups is not None else None,
        loss_reduction=loss_reduction,
        channel_mode=channel_mode,
        event_log=event_log,
        implicit_local=implicit_local,
        **extra,
    )


def _torch_ops(name: str, pp: int, chunks: int, m: int):
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    key = canonical_name(name)
    if key in ("gpipe", "1f1b"):
        # torch's single-stage classes run hand-written loops; their IR is only a
        # picture, and 1F1B's is invalid on the last rank (design note §2.11 item 1).
        raise ValueError(
            f"source='torch' has no executable IR for {name}: torch runs it as a "
            "hand-written loop. Use source='cadence'."
        )
    placement = placement_for(key, pp, chunks)
    lowered = get_schedule_ops(_TORCH_NAMES[key], pp, m, chunks, with_comms=True)
    return from_torch_actions({r: lowered[r] for r in range(pp)}, placement), placement
