"""``PipelineStage`` with torch's signature, and torch's own stages taken as cadence's.

A `PipelineStage` here *is* a cadence runtime stage (`cadence.pipeline.Stage`)
built from torch's constructor arguments, so the schedules hand it to `PipelineRuntime`
unchanged. It also keeps what torch's schedules return and cadence's runtime does
not: each last-stage output as the module returned it, graph included (torch's
``step`` merges those), and which microbatch is in flight (so a loss can be filed
under it).

`as_stage` takes torch's stages too: ``torch.distributed.pipelining.PipelineStage``
and the ``_PipelineStage`` that ``Pipe.build_stage`` returns. From those it keeps the
module, index, stage count, device and group; a traced pipe's dataflow is checked
against what cadence's runtime carries (see [Note: a traced pipe's dataflow]).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.stage import _PipelineStage, _PipelineStageBase

from cadence.pipeline.runtime.errors import PipelineUsageError
from cadence.pipeline.runtime.stage import Stage as RuntimeStage
from cadence.pipeline.runtime.stage import TensorMeta

__all__ = ["PipelineStage", "as_stage"]

_FIX_SUBGROUP = (
    "cadence.pipelining runs one pipeline over the default group; for a pipeline "
    "over part of the world (pp x dp), build it with cadence.init(cadence.Topology("
    "pp=...)) and cadence.pipeline.build_pipeline(..., groups=...)"
)


class PipelineStage(RuntimeStage):
    """torch's ``PipelineStage(submodule, stage_index, num_stages, device, ...)``, run by cadence.

    Args:
        submodule: this stage's module.
        stage_index, num_stages: position in the pipeline and the stage count.
        device: where the stage runs and its receive buffers live.
        input_args, output_args: example per-microbatch inputs / outputs (a tensor
            or a tuple). When given they become the static metadata; otherwise it is
            inferred on the first step (without drawing random numbers).
        output_grads, input_grads: accepted when they match ``output_args`` /
            ``input_args`` in shape and dtype (cadence's gradients always do).
        group: ``None`` or a group of the whole world, in rank order.
        dw_builder, get_mesh: refused (see the messages).
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str,
        input_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_grads: torch.Tensor | tuple[torch.Tensor | None, ...] | None = None,
        input_grads: torch.Tensor | tuple[torch.Tensor | None, ...] | None = None,
        group: dist.ProcessGroup | None = None,
        dw_builder: Callable[[], Callable[..., None]] | None = None,
        get_mesh: Any = None,
    ) -> None:
        if dw_builder is not None:
            raise PipelineUsageError(
                "PipelineStage(dw_builder=...) is not supported: cadence splits a backward "
                "into I and W itself (each weight's own AccumulateGrad runs in W), and has "
                "no hook for a custom weight-gradient runner. Remove dw_builder=."
            )
        if get_mesh is not None:
            raise PipelineUsageError(
                "PipelineStage(get_mesh=...) is not supported: cadence's stage boundaries "
                "carry plain tensors, not DTensors. Remove get_mesh= and send local tensors."
            )
        _check_group(group)
        inputs = _metas(input_args, "input_args")
        outputs = _metas(output_args, "output_args")
        _check_grads(output_grads, outputs, "output_grads", "output_args")
        _check_grads(input_grads, inputs, "input_grads", "input_args")
        super().__init__(
            submodule,
            stage_index,
            num_stages,
            device=device,
            input_meta=inputs,
            output_meta=outputs,
        )
        self.group = group
        # The microbatch whose forward runs now; on the last stage, its outputs as the
        # module returned them and the loss_fn's result, by microbatch (what torch's
        # schedules hand back; see [Note: what torch's stages release]).
        self.current_mb: int | None = None
        self.torch_outputs: dict[int, Any] = {}
        self.torch_losses: dict[int, torch.Tensor] = {}

    @property
    def submod(self) -> nn.Module:
        """torch's name for the stage module (the tutorial builds its optimizer from it)."""
        return self.module

    @property
    def group_rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def group_size(self) -> int:
        return dist.get_world_size(self.group)

    def forward(
        self, mb: int, inputs: Sequence[torch.Tensor], *, how: str = "input"
    ) -> tuple[torch.Tensor, ...]:
        self.current_mb = mb
        out = super().forward(mb, inputs, how=how)
        if self.is_last:
            self.torch_outputs[mb] = out[0] if len(out) == 1 else out
        return out

    def backward(
        self, mb: int, grads: Sequence[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ...] | None:
        out = super().backward(mb, grads)
        self._release(mb, loss=False)
        return out

    def backward_input(
        self, mb: int, grads: Sequence[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ...] | None:
        out = super().backward_input(mb, grads)
        self._release(mb, loss=True)
        return out

    def _release(self, mb: int, *, loss: bool) -> None:
        """Detach in place what torch's stage detaches after a backward.

        [Note: what torch's stages release]
        After the backward of a microbatch, torch's last stage (when it is not also
        the first) detaches its outputs in place (those that are not views) to free
        the graph early, so the output ``step`` returns carries no graph; an input
        half (I, in the zero-bubble schedules) also detaches the loss it started
        from, so those loss entries carry no ``grad_fn`` while full-backward ones do.
        The same tensors are detached here, after the same actions, so ``losses``
        and the output carry what torch's carry.
        """
        if not self.is_last or self.is_first:
            return
        out = self.torch_outputs.get(mb)
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor) and not t._is_view():
                t.detach_()
        if loss and mb in self.torch_losses:
            self.torch_losses[mb].detach_()


def as_stage(stage: Any) -> PipelineStage:
    """cadence's stage for one of ``cadence.pipelining.PipelineStage`` or torch's stages."""
    if isinstance(stage, PipelineStage):
        return stage
    if not isinstance(stage, _PipelineStageBase):
        raise PipelineUsageError(
            f"expected a PipelineStage, got {type(stage).__name__}; build one with "
            "cadence.pipelining.PipelineStage(module, stage_index, num_stages, device) "
            "or pipe.build_stage(stage_index, device)"
        )
    if getattr(stage, "dw_builder", None) is not None:
        raise PipelineUsageError(
            f"torch stage {stage.stage_index} has a dw_builder: cadence splits a backward "
            "into I and W itself and has no hook for a custom runner. Build the stage "
            "without dw_builder="
        )
    if getattr(stage, "_forward_contexts", None):
        raise PipelineUsageError(
            f"torch stage {stage.stage_index} has forward contexts "
            "(register_forward_context); cadence's runtime does not enter them. Wrap the "
            "stage module's forward in the context instead"
        )
    if isinstance(stage, _PipelineStage):
        check_traced_dataflow(stage.pipe_info.graph)
    return PipelineStage(
        stage.submod, stage.stage_index, stage.num_stages, stage.device, group=stage.group
    )


def check_traced_dataflow(graph: torch.fx.Graph) -> None:
    """Refuse a traced pipe whose dataflow cadence's runtime cannot carry.

    [Note: a traced pipe's dataflow]
    cadence's runtime hands stage s's outputs, in order, to stage s + 1 as its
    positional inputs, and the batch given to ``step`` to stage 0. A pipe from
    ``torch.distributed.pipelining.pipeline`` may route values otherwise: a model
    input read by a later stage (an attention mask), an output skipping a stage, or
    keyword inputs. Those would arrive in the wrong place, so the whole graph is
    checked on every rank (each refuses alike, before any communication).
    """
    nodes = [n for n in graph.nodes if n.op == "call_module"]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for s, node in enumerate(nodes):
        if node.kwargs:
            raise PipelineUsageError(
                f"traced stage {s} takes keyword inputs {sorted(node.kwargs)}; cadence passes "
                "stage inputs by position. Make the model's forward take them positionally"
            )
        expected = placeholders if s == 0 else _outputs_of(nodes[s - 1], s - 1)
        if list(node.args) != list(expected):
            raise PipelineUsageError(
                f"traced stage {s} reads {[str(a) for a in node.args]}, but cadence's runtime "
                f"feeds it {[str(a) for a in expected]} (the "
                + ("model inputs, in order" if s == 0 else f"outputs of stage {s - 1}, in order")
                + "): a model input read after stage 0, or a value that skips a stage, is not "
                "carried. Relay such values through every stage in between (return them "
                "from each stage)"
            )


def _outputs_of(node: torch.fx.Node, s: int) -> list[torch.fx.Node]:
    items = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
    if not items:
        return [node]
    items.sort(key=lambda u: u.args[1])  # type: ignore[arg-type,return-value]
    if [u.args[1] for u in items] != list(range(len(items))) or len(items) != len(node.users):
        raise PipelineUsageError(
            f"traced stage {s}'s outputs are used as {[str(u) for u in node.users]}; cadence "
            "sends every output of a stage, in order, to the next stage only"
        )
    return items


def _check_group(group: dist.ProcessGroup | None) -> None:
    if group is None:
        return
    ranks = dist.get_process_group_ranks(group)
    if ranks != list(range(dist.get_world_size())):
        raise PipelineUsageError(f"group= has ranks {ranks}, not the whole world. {_FIX_SUBGROUP}")


def _metas(args: Any, what: str) -> tuple[TensorMeta, ...] | None:
    if args is None:
        return None
    items = (args,) if isinstance(args, torch.Tensor) else tuple(args)
    if not all(isinstance(t, torch.Tensor) and not _is_dtensor(t) for t in items):
        raise PipelineUsageError(
            f"{what} must be a tensor or a tuple of plain tensors (cadence's stage "
            f"boundaries carry tensors, not DTensors or other objects), got {type(args).__name__}"
        )
    return tuple(TensorMeta.of(t) for t in items)


def _check_grads(grads: Any, metas: tuple[TensorMeta, ...] | None, what: str, of: str) -> None:
    if grads is None:
        return
    items = (grads,) if isinstance(grads, torch.Tensor) else tuple(grads)
    given = tuple(None if g is None else TensorMeta.of(g) for g in items)
    if (
        metas is None
        or any(g is not None and g != m for g, m in zip(given, metas))
        or len(given) != len(metas)
    ):
        raise PipelineUsageError(
            f"{what} must match {of} in number, shape and dtype: cadence's gradients "
            f"always have the shape of the tensors they belong to. Remove {what}= or pass {of}="
        )


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"
