"""What every ``cadence.pipelining`` schedule shares: build on first use, ``step``, ``eval``.

A schedule object holds torch's constructor arguments and this rank's stages. The
first ``step`` (or ``eval``), which every rank calls, builds the one runtime:
cadence's generator writes the schedule, ``lower`` adds the transfers in one global
message order, and `PipelineRuntime` proves it with the simulator, votes on the
plan, derives and preconnects the per-edge channels, then runs it. Nothing here
executes an action.

[Note: torch's step contract on cadence's runtime]
What a torch caller sees, and how it is met:

- Losses: torch's ``losses`` list is cleared, then holds one loss per microbatch,
  each the tensor its ``loss_fn`` returned, on the rank of the last stage. cadence's runtime reports detached losses, so the loss function is
  wrapped and its results are filed by microbatch as the runtime computes them.
- Gradient scale: torch runs every backward from the unscaled loss and, with
  ``scale_grads=True``, divides each local stage's gradients by the microbatch count
  after the step (all of ``.grad``, so gradients accumulated over two steps
  without ``zero_grad`` are divided again). The runtime runs with
  ``loss_reduction="sum"`` and this layer divides the same way, so gradients match
  torch's bit for bit. ``cadence.pipeline.build_pipeline`` instead scales each
  loss once (see [Note: loss scaling is applied once, to the loss] in
  ``pipeline/runtime/microbatch.py``).
- Output: the last stage's outputs as the module returned them, merged with
  torch's ``merge_chunks`` and ``output_merge_spec``. Where torch's stage detaches
  outputs or losses in place after a backward, cadence's does too (see [Note:
  what torch's stages release] in ``stage.py``), so both carry a graph exactly
  where torch's do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import TensorChunkSpec, merge_chunks

from cadence.pipeline.runtime.errors import PipelineUsageError
from cadence.pipeline.runtime.executor import PipelineRuntime
from cadence.pipeline.schedule.generators import generate
from cadence.pipeline.schedule.ir import Schedule
from cadence.pipeline.schedule.passes import lower
from cadence.pipelining.stage import PipelineStage, as_stage

__all__ = ["CompatSchedule", "refuse_knobs"]

_FIX = "or use cadence.pipeline.build_pipeline, which has cadence's own options"


def refuse_knobs(cls: str, given: Mapping[str, tuple[Any, Any, str]]) -> None:
    """Raise for a torch-only option set away from its default: ``{name: (value, default, why)}``."""
    for name, (value, default, why) in given.items():
        if value != default:
            raise PipelineUsageError(
                f"{cls}({name}={value!r}) is not supported: {why}. Leave {name} at its "
                f"default ({default!r}), {_FIX}"
            )


class CompatSchedule:
    """One torch schedule class on cadence's runtime (the classes in ``schedules.py``).

    Attributes:
        generator: cadence's generator name for this class (``generators.py``).
    """

    generator = ""

    def __init__(
        self,
        stages: Sequence[Any],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None,
        scale_grads: bool,
    ) -> None:
        name = type(self).__name__
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise PipelineUsageError(f"{name}: n_microbatches={n_microbatches!r}; use an int >= 1")
        if args_chunk_spec is not None and not all(
            isinstance(s, TensorChunkSpec) and s.split_dim == 0 for s in args_chunk_spec
        ):
            raise PipelineUsageError(
                f"{name}(args_chunk_spec={args_chunk_spec!r}) is not supported: cadence splits "
                "every input along dim 0. Pass inputs with the batch in dim 0 and leave "
                "args_chunk_spec=None"
            )
        if kwargs_chunk_spec is not None:
            raise PipelineUsageError(
                f"{name}(kwargs_chunk_spec=...) is not supported: cadence's stages take "
                "positional inputs only. Pass the inputs to step() positionally"
            )
        self._stages = [as_stage(s) for s in stages]
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        self._runtime: PipelineRuntime | None = None
        self._loss_kwargs: dict[str, Any] = {}
        self._last = next((s for s in self._stages if s.is_last), None)

    # -- what torch's schedules expose ------------------------------------------

    @property
    def runtime(self) -> PipelineRuntime:
        """cadence's runtime for this schedule (built collectively on first use)."""
        if self._runtime is None:
            self._runtime = self._build()
        return self._runtime

    @property
    def stages(self) -> tuple[PipelineStage, ...]:
        """This rank's stages, as cadence runs them (torch's stages taken as cadence's)."""
        return tuple(self._stages)

    @property
    def lowered(self) -> Schedule:
        """The lowered schedule every rank runs (the simulator proved it)."""
        return self.runtime.schedule

    def compute_schedule(self, p: int, m: int, v: int) -> Schedule:
        """The compute-only schedule this class runs: its cadence generator's."""
        return generate(self.generator, p, m, v)

    # -- step / eval ------------------------------------------------------------

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[torch.Tensor] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: Any = None,
        kwarg_mbs: Any = None,
        target_mbs: Any = None,
        finalize_gradients: bool = True,
        **kwargs: Any,
    ) -> Any:
        """One training step over the whole batch, as torch's ``step``.

        Returns the merged last-stage output on the rank that holds the last stage
        (``None`` elsewhere, or with ``return_outputs=False``); ``losses`` gets one
        loss per microbatch there. Without a ``loss_fn`` the step runs the forward
        only (as torch's), without keeping a graph.
        """
        self._refuse_step_args(kwargs, arg_mbs, kwarg_mbs, target_mbs)
        if not finalize_gradients:
            raise PipelineUsageError(
                "step(finalize_gradients=False) is not supported: it defers torch FSDP's "
                "reduction. cadence's accumulation step is "
                "cadence.pipeline.build_pipeline(...).step(..., sync_gradients=False)"
            )
        if self._loss_fn is None:
            return self.eval(*args, target=target, losses=losses, return_outputs=return_outputs)
        rt = self.runtime
        self._begin(loss_kwargs)
        rt.step(*args, target=target)
        if self.scale_grads and self._n_microbatches != 1:
            # torch's scale_grads: every local stage's .grad, after its last backward.
            with torch.no_grad():
                for st in self._stages:
                    for p in st.module.parameters():
                        if p.grad is not None:
                            p.grad.div_(self._n_microbatches)
        return self._finish(losses, return_outputs)

    def eval(
        self,
        *args: Any,
        target: Any = None,
        losses: list[torch.Tensor] | None = None,
        return_outputs: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Forward only, under ``no_grad``: the F actions and their activation transfers."""
        self._refuse_step_args(kwargs, None, None, None)
        rt = self.runtime
        self._begin(None)
        rt.eval(*args, target=target)
        return self._finish(losses, return_outputs)

    # -- internals --------------------------------------------------------------

    def _refuse_step_args(
        self, kwargs: dict[str, Any], arg_mbs: Any, kwarg_mbs: Any, target_mbs: Any
    ) -> None:
        if kwargs:
            raise PipelineUsageError(
                f"step() got keyword inputs {sorted(kwargs)}: cadence's stages take positional "
                "inputs only. Pass them positionally, in the order stage 0's forward takes them"
            )
        if arg_mbs is not None or kwarg_mbs is not None or target_mbs is not None:
            raise PipelineUsageError(
                "step(arg_mbs=/kwarg_mbs=/target_mbs=) is not supported: cadence splits the "
                "whole batch itself (dim 0, equal microbatches). Pass the whole batch and target="
            )

    def _build(self) -> PipelineRuntime:
        p = dist.get_world_size()
        compute = self.compute_schedule(p, self._n_microbatches, len(self._stages))
        loss = self._record_loss if self._loss_fn is not None else None
        return PipelineRuntime(lower(compute), self._stages, loss_fn=loss, loss_reduction="sum")

    def _begin(self, loss_kwargs: dict[str, Any] | None) -> None:
        self._loss_kwargs = dict(loss_kwargs or {})
        for st in self._stages:
            st.torch_outputs.clear()
            st.torch_losses.clear()

    def _record_loss(self, *outputs_and_target: Any) -> torch.Tensor:
        # The runtime calls loss_fn(*outputs, target) right after the last stage's F.
        *outs, target = outputs_and_target
        out = outs[0] if len(outs) == 1 else tuple(outs)
        assert self._loss_fn is not None and self._last is not None
        loss = self._loss_fn(out, target, **self._loss_kwargs)
        self._last.torch_losses[self._last.current_mb] = loss  # type: ignore[index]
        return loss

    def _finish(self, losses: list[torch.Tensor] | None, return_outputs: bool) -> Any:
        last = self._last
        if last is None:
            return None
        if losses is not None and last.torch_losses:
            losses.clear()
            losses.extend(last.torch_losses[mb] for mb in sorted(last.torch_losses))
        chunks = [last.torch_outputs[mb] for mb in sorted(last.torch_outputs)]
        last.torch_outputs.clear()
        last.torch_losses.clear()
        if not return_outputs or not chunks:
            return None
        return merge_chunks(chunks, self._output_merge_spec)


def stage_list(cls: str, stages: Any) -> list[Any]:
    """A multi-stage schedule's ``stages`` argument as a list (torch takes a list)."""
    if isinstance(stages, (list, tuple)) and stages:
        return list(stages)
    raise PipelineUsageError(
        f"{cls} takes a non-empty list of this rank's stages, got {type(stages).__name__}"
    )


def single_stage(cls: str, stage: Any) -> list[Any]:
    """A single-stage schedule's ``stage`` argument as a one-element list."""
    if isinstance(stage, (list, tuple)):
        raise PipelineUsageError(
            f"{cls} takes one stage per rank, got a {type(stage).__name__}; for several "
            "stages per rank use ScheduleInterleaved1F1B or ScheduleLoopedBFS"
        )
    return [stage]
