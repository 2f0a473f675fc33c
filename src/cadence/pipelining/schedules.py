"""torch's schedule classes, with torch's constructors, on cadence's generators.

Each class names the cadence generator that writes the same schedule
(``torch_schedule_name`` in ``pipeline/schedule/generators.py`` is the same map the
other way) and takes torch's arguments in torch's order: the union of torch 2.13's
and 2.15's, which differ only by options 2.15 added after ``defer_pp_recv``.
Options that tune torch's own executor (receive deferral, FSDP unshard caps, send
throttling, deferred reduction waits, a backward without autograd) have no meaning
on cadence's runtime: left at their defaults they are accepted, set otherwise they
are refused with the reason and the way to get the effect in cadence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.distributed.pipelining.microbatch import TensorChunkSpec

from cadence.pipeline.schedule.generators import generate
from cadence.pipeline.schedule.ir import Action, ActionKind, Schedule
from cadence.pipelining._base import CompatSchedule, refuse_knobs, single_stage, stage_list

__all__ = [
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
]

_ORDER = (
    "cadence orders every transfer in one global message order that lower() proves deadlock-free"
)
_UNSHARD = (
    "cadence places a stage's all-gather on the schedule with "
    "build_pipeline(..., unshard_lookahead=L) instead"
)


class PipelineScheduleSingle(CompatSchedule):
    """One stage per rank: ``(stage, n_microbatches, loss_fn, args_chunk_spec, ...)``."""

    def __init__(
        self,
        stage: Any,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
    ) -> None:
        super().__init__(
            single_stage(type(self).__name__, stage),
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
        )
        self._stage = self._stages[0]


class ScheduleGPipe(PipelineScheduleSingle):
    """All forwards, then all backwards (cadence's ``gpipe``)."""

    generator = "gpipe"


class Schedule1F1B(PipelineScheduleSingle):
    """One forward, one backward in the steady state (cadence's ``1f1b``; any m >= 1)."""

    generator = "1f1b"


class PipelineScheduleMulti(CompatSchedule):
    """Several stages per rank: torch 2.15's constructor (2.13's is its prefix)."""

    def __init__(
        self,
        stages: list[Any],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        max_active_stages: int = 3,
        unshard_lookahead: Literal["full", "auto"] | tuple[int, ...] = "full",
        *,
        defer_reduce_grad_wait: bool = False,
        max_outstanding_sends: int | None = None,
    ) -> None:
        name = type(self).__name__
        refuse_knobs(
            name,
            {
                "backward_requires_autograd": (
                    backward_requires_autograd,
                    True,
                    "cadence's stages run every backward through autograd",
                ),
                "defer_pp_recv": (defer_pp_recv, False, _ORDER),
                "max_active_stages": (max_active_stages, 3, _UNSHARD),
                "unshard_lookahead": (unshard_lookahead, "full", _UNSHARD),
                "defer_reduce_grad_wait": (
                    defer_reduce_grad_wait,
                    False,
                    "cadence defers reduction waits with "
                    "build_pipeline(..., max_outstanding_reductions=K)",
                ),
                "max_outstanding_sends": (
                    max_outstanding_sends,
                    None,
                    "cadence waits each send at its WAIT_SEND or at the end of the step",
                ),
            },
        )
        super().__init__(
            stage_list(name, stages),
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
        )


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """Interleaved 1F1B over a loop placement (cadence's ``interleaved``)."""

    generator = "interleaved"


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """Interleaved zero bubble, I/W split (cadence's ``zb_h1``)."""

    generator = "zb_h1"


class ScheduleZBVZeroBubble(PipelineScheduleMulti):
    """ZBV: two stages per rank in a V (cadence's ``zbv``)."""

    generator = "zbv"


class ScheduleDualPipeV(PipelineScheduleMulti):
    """DualPipeV: a V with overlapped F/B pairs (cadence's ``dualpipev``; m >= 2p)."""

    generator = "dualpipev"


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Looped breadth first (cadence's ``looped_bfs``); torch's constructor has no chunk specs."""

    generator = "looped_bfs"

    def __init__(
        self,
        stages: list[Any],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        max_active_stages: int = 3,
        unshard_lookahead: Literal["full", "auto"] | tuple[int, ...] = "full",
        *,
        defer_reduce_grad_wait: bool = False,
        max_outstanding_sends: int | None = None,
    ) -> None:
        super().__init__(
            stages,
            n_microbatches,
            loss_fn,
            None,
            None,
            output_merge_spec,
            scale_grads,
            backward_requires_autograd,
            defer_pp_recv,
            max_active_stages,
            unshard_lookahead,
            defer_reduce_grad_wait=defer_reduce_grad_wait,
            max_outstanding_sends=max_outstanding_sends,
        )

    def compute_schedule(self, p: int, m: int, v: int) -> Schedule:
        """cadence's LoopedBFS with each stage's backwards in torch's order.

        torch runs a stage's backwards from the last microbatch down, cadence's
        generator from the first; makespan and peak are the same, but the order is
        the order in which gradients accumulate, so torch's is kept here for
        gradients equal to torch's bit for bit.
        """
        base = generate(self.generator, p, m, v)
        rows = [_reverse_backward_runs(acts) for acts in base.ranks]
        return Schedule.from_lists(rows, base.placement, generator=self.generator, v=v, m=m)


def _reverse_backward_runs(actions: tuple[Action, ...]) -> list[Action]:
    """Each run of consecutive full backwards of one stage, in reverse order."""
    out: list[Action] = []
    run: list[Action] = []
    for a in (*actions, None):
        if a is not None and a.kind is ActionKind.B and (not run or run[0].stage == a.stage):
            run.append(a)
            continue
        out.extend(reversed(run))
        run = [a] if a is not None and a.kind is ActionKind.B else []
        if a is not None and a.kind is not ActionKind.B:
            out.append(a)
    return out
