"""``pipeline(...)``: torch's tracer front end, with ``build_stage`` giving cadence's stage.

Tracing and splitting are torch's (``torch.distributed.pipelining.pipeline``); only
the stage a pipe builds changes. torch's own ``Pipe.build_stage`` output is accepted
by every ``cadence.pipelining`` schedule as well (`as_stage`), so a script may keep
torch's ``pipeline`` import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.pipelining import Pipe as TorchPipe
from torch.distributed.pipelining import SplitPoint
from torch.distributed.pipelining import pipeline as torch_pipeline

from cadence.pipelining.stage import PipelineStage, as_stage

__all__ = ["Pipe", "pipeline"]


class Pipe:
    """torch's ``Pipe``, whose ``build_stage`` returns a `cadence.pipelining.PipelineStage`.

    Every other attribute (``split_gm``, ``num_stages``, ``info()``, printing) is torch's.
    """

    def __init__(self, pipe: TorchPipe) -> None:
        self.torch_pipe = pipe

    def build_stage(
        self,
        stage_index: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> PipelineStage:
        # torch's build moves the module to the device and rewrites device constants
        # the trace burned in; the result is then taken as cadence's stage.
        return as_stage(self.torch_pipe.build_stage(stage_index, device, group))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.torch_pipe, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.torch_pipe(*args, **kwargs)

    def __str__(self) -> str:
        return str(self.torch_pipe)

    def __repr__(self) -> str:
        return repr(self.torch_pipe)


def pipeline(
    module: torch.nn.Module,
    mb_args: tuple[Any, ...],
    mb_kwargs: dict[str, Any] | None = None,
    split_spec: dict[str, SplitPoint] | None = None,
    split_policy: Callable[[fx.GraphModule], fx.GraphModule] | None = None,
) -> Pipe:
    """torch's ``pipeline(module, mb_args, mb_kwargs, split_spec, split_policy)``."""
    return Pipe(
        torch_pipeline(
            module,
            mb_args=mb_args,
            mb_kwargs=mb_kwargs,
            split_spec=split_spec,
            split_policy=split_policy,
        )
    )
