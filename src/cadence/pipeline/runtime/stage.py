"""One pipeline stage: a module chunk, its tensor metadata, and F / B / I / W.

The executor (``executor.py``) owns *when* each of these runs; this file owns
*what* they compute. Nothing here communicates.

[Note: metadata and short messages]
gloo silently accepts a message shorter than the receive buffer: a batch of 30
split into 4 microbatches gives chunks of 8, 8, 7, 7, and the 7-row activation
lands in an 8-row receive buffer with no transport error; the failure surfaces
later as a confusing shape error in the loss, or not at all. So every tensor that
*enters* a stage (received, handed over locally, or given by the user) is checked
against the stage's ``input_meta``, and every tensor that *leaves* it is checked
against ``output_meta`` before it is sent. Receive buffers are allocated from the
same metadata on the other side, which both ranks agreed on before the first
step, so a sender check is also a check of what the receiver will see.

[Note: split backward]
Zero-bubble schedules split a backward into I (gradient w.r.t. the stage inputs,
on the critical path) and W (gradient w.r.t. the weights, deferrable). I keeps the
autograd graph alive; W later walks only the part of the graph that leads to the
weights, and accumulates through the parameters' own AccumulateGrad nodes so that
data-parallel wrappers see W as the parameter half of a backward: see [Note: W
accumulates through the leaves] in ``split_backward.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cadence.pipeline.runtime.errors import (
    PipelineStateError,
    PipelineUsageError,
    StageShapeError,
)
from cadence.pipeline.runtime.split_backward import SplitBackward, backward_input

__all__ = ["Stage", "StageShapeError", "TensorMeta"]


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one per-microbatch tensor crossing a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        return cls(tuple(t.shape), t.dtype)

    def empty(self, device: torch.device | str) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def check(self, t: torch.Tensor, what: str) -> None:
        if not isinstance(t, torch.Tensor):
            raise StageShapeError(f"{what}: expected a tensor, got {type(t).__name__}")
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise StageShapeError(
                f"{what}: got shape {tuple(t.shape)} dtype {t.dtype}, but the pipeline "
                f"plan expects shape {self.shape} dtype {self.dtype}. Every microbatch "
                "must have the same shape (split the batch evenly), and a stage must "
                "return the same shapes on every microbatch; otherwise pass matching "
                "input_meta/output_meta."
            )


Metas = tuple[TensorMeta, ...]


def _as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    raise TypeError(
        f"a pipeline stage must return a tensor or a tuple of tensors, got {type(x).__name__}"
    )


def _as_metas(meta: TensorMeta | Sequence[TensorMeta] | None) -> Metas | None:
    if meta is None:
        return None
    if isinstance(meta, TensorMeta):
        return (meta,)
    return tuple(meta)


class Stage:
    """A module chunk at position ``stage_index`` of ``num_stages``.

    cadence's one stage class. `cadence.pipelining.PipelineStage` is this class with
    torch's constructor (a subclass, for an import swap from
    ``torch.distributed.pipelining``); `cadence.pipeline.build_pipeline` builds these
    from a model and a schedule, so most code never constructs one.

    Args:
        module: this stage's chunk (any ``nn.Module``, possibly wrapped in a
            data-parallel wrapper; see ``grad_sync.py``).
        stage_index: position in the pipeline, from 0.
        num_stages: total number of stages (across all ranks).
        device: where the stage runs and receive buffers live.
        input_meta: per-microbatch input metadata (stages > 0). ``None`` means
            inferred from the first step (one forward per stage on zeros, in
            stage order; see ``executor.py``).
        output_meta: per-microbatch output metadata; ``None`` means inferred.
    """

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        *,
        device: torch.device | str = "cpu",
        input_meta: TensorMeta | Sequence[TensorMeta] | None = None,
        output_meta: TensorMeta | Sequence[TensorMeta] | None = None,
    ) -> None:
        if not 0 <= stage_index < num_stages:
            raise PipelineUsageError(
                f"stage_index={stage_index} must be in [0, num_stages={num_stages})"
            )
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.input_meta: Metas | None = _as_metas(input_meta)
        self.output_meta: Metas | None = _as_metas(output_meta)
        # -- per-microbatch state, cleared by the backward that consumes it
        self._inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._split: dict[int, SplitBackward] = {}

    # -- properties -------------------------------------------------------------

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"Stage({self.stage_index}/{self.num_stages}, {type(self.module).__name__})"

    # -- metadata ---------------------------------------------------------------

    def infer_output_meta(self, inputs: Sequence[torch.Tensor]) -> Metas:
        """Run the module once without grad on ``inputs`` and record its output metadata.

        [Note: shape inference draws no random numbers]
        The run happens before the first step, on the rank's own generators. A module
        that draws random numbers in its forward (``F.dropout(x, p)``, whose
        ``training`` defaults to True even in eval mode; noise layers; ``torch.rand``)
        would advance them, and every step after would see other masks than the same
        model under torch's pipelining, whose inference runs on meta tensors and draws
        nothing. So the generators of the stage's device (and the CPU's) are forked
        around the run and come back as they were.
        """
        devices = [self.device] if self.device.type != "cpu" else []
        device_type = self.device.type if self.device.type != "cpu" else "cuda"
        with torch.no_grad(), torch.random.fork_rng(devices=devices, device_type=device_type):
            out = _as_tuple(self.module(*inputs))
        self.output_meta = tuple(TensorMeta.of(t) for t in out)
        return self.output_meta

    def input_buffers(self) -> tuple[torch.Tensor, ...]:
        """Fresh receive buffers for one microbatch's inputs."""
        if self.input_meta is None:
            raise PipelineStateError(f"{self}: input metadata is not known yet")
        return tuple(m.empty(self.device) for m in self.input_meta)

    def grad_buffers(self) -> tuple[torch.Tensor, ...]:
        """Fresh receive buffers for one microbatch's output gradients."""
        if self.output_meta is None:
            raise PipelineStateError(f"{self}: output metadata is not known yet")
        return tuple(m.empty(self.device) for m in self.output_meta)

    def check_inputs(self, inputs: Sequence[torch.Tensor], mb: int, how: str) -> None:
        if self.input_meta is None:
            return
        if len(inputs) != len(self.input_meta):
            raise StageShapeError(
                f"stage {self.stage_index} microbatch {mb} ({how}): got {len(inputs)} "
                f"inputs, the plan expects {len(self.input_meta)}"
            )
        for i, (t, m) in enumerate(zip(inputs, self.input_meta)):
            m.check(t, f"stage {self.stage_index} microbatch {mb} input {i} ({how})")

    def check_grads(self, grads: Sequence[torch.Tensor], mb: int, how: str) -> None:
        assert self.output_meta is not None
        for i, (t, m) in enumerate(zip(grads, self.output_meta)):
            m.check(t, f"stage {self.stage_index} microbatch {mb} output-grad {i} ({how})")

    # -- compute ----------------------------------------------------------------

    def forward(
        self, mb: int, inputs: Sequence[torch.Tensor], *, how: str = "input"
    ) -> tuple[torch.Tensor, ...]:
        """F: run the chunk on microbatch ``mb``; returns the output tuple (kept for B/I)."""
        self.check_inputs(inputs, mb, how)
        if self.is_first:
            args = tuple(inputs)
        else:
            # A fresh leaf per microbatch: its .grad is what B/I hand to stage s-1.
            args = tuple(
                t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in inputs
            )
        out = _as_tuple(self.module(*args))
        if self.output_meta is not None:
            for i, (t, m) in enumerate(zip(out, self.output_meta)):
                m.check(t, f"stage {self.stage_index} microbatch {mb} output {i}")
        self._inputs[mb] = args
        self._outputs[mb] = out
        return out

    def set_loss(self, mb: int, loss: torch.Tensor) -> None:
        """On the last stage: the (scaled) loss that this microbatch's backward starts from."""
        self._losses[mb] = loss

    def _roots(
        self, mb: int, grads: Sequence[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if self.is_last:
            if mb not in self._losses:
                raise PipelineStateError(
                    f"stage {self.stage_index} microbatch {mb}: backward before its loss "
                    "was computed (did forward run with a loss_fn?)"
                )
            return [self._losses.pop(mb)], None
        if grads is None:
            raise PipelineStateError(
                f"stage {self.stage_index} microbatch {mb}: no output gradient"
            )
        outs = self._outputs.pop(mb)
        roots: list[torch.Tensor] = []
        rgrads: list[torch.Tensor] = []
        for o, g in zip(outs, grads):
            if o.requires_grad:
                roots.append(o)
                rgrads.append(g)
        return roots, rgrads

    def _take_inputs(self, mb: int) -> tuple[torch.Tensor, ...]:
        if mb not in self._inputs:
            raise PipelineStateError(
                f"stage {self.stage_index} microbatch {mb}: backward without a forward"
            )
        return self._inputs[mb]

    def _input_grads(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        if self.is_first:
            return None
        return tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs)

    def backward(
        self, mb: int, grads: Sequence[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ...] | None:
        """B: full backward of ``mb``; returns the input gradients (``None`` on stage 0)."""
        inputs = self._take_inputs(mb)
        roots, rgrads = self._roots(mb, grads)
        self._outputs.pop(mb, None)
        if roots:
            torch.autograd.backward(roots, grad_tensors=rgrads)
        del self._inputs[mb]
        return self._input_grads(inputs)

    def backward_input(
        self, mb: int, grads: Sequence[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ...] | None:
        """I: gradient w.r.t. the inputs only, keeping what W needs; returns input grads."""
        inputs = self._take_inputs(mb)
        roots, rgrads = self._roots(mb, grads)
        self._outputs.pop(mb, None)
        dins, self._split[mb] = backward_input(roots, rgrads, inputs)
        if self.is_first:
            return None
        return tuple(torch.zeros_like(t) if d is None else d for t, d in zip(inputs, dins))

    def backward_weight(self, mb: int) -> None:
        """W: accumulate the weight gradients of ``mb`` (after its I)."""
        split = self._split.pop(mb, None)
        if split is None:
            raise PipelineStateError(
                f"stage {self.stage_index} microbatch {mb}: W without a preceding I"
            )
        split.run_weight()
        self._inputs.pop(mb, None)

    def clear(self) -> None:
        """Drop every per-microbatch cache (end of a step, or after an error)."""
        self._inputs.clear()
        self._outputs.clear()
        self._losses.clear()
        self._split.clear()
