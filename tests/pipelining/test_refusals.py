"""What ``cadence.pipelining`` refuses, in one process (no process group).

Specification: an argument torch accepts and cadence cannot honour raises
`PipelineUsageError` when it is given, naming the argument and the fix; nothing
is silently ignored. torch-only options at their defaults are accepted.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint
from torch.distributed.pipelining import pipeline as torch_pipeline
from torch.distributed.pipelining.microbatch import TensorChunkSpec

from cadence.pipeline.runtime.errors import PipelineUsageError
from cadence.pipelining import (
    PipelineStage,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from cadence.pipelining.stage import check_traced_dataflow

CPU = torch.device("cpu")


def _stage(index: int = 0, num_stages: int = 2) -> PipelineStage:
    return PipelineStage(nn.Linear(4, 4), index, num_stages, CPU)


def test_dw_builder_is_refused_naming_it_and_the_fix() -> None:
    with pytest.raises(PipelineUsageError, match=r"dw_builder=.*Remove dw_builder="):
        PipelineStage(nn.Linear(4, 4), 0, 2, CPU, dw_builder=lambda: lambda: None)


def test_get_mesh_is_refused_naming_it_and_the_fix() -> None:
    with pytest.raises(PipelineUsageError, match=r"get_mesh=.*Remove get_mesh="):
        PipelineStage(nn.Linear(4, 4), 0, 2, CPU, get_mesh=object())


def test_example_args_become_the_stages_static_metadata() -> None:
    st = PipelineStage(
        nn.Linear(4, 3), 1, 2, CPU, input_args=torch.zeros(2, 4), output_args=torch.zeros(2, 3)
    )
    assert [m.shape for m in st.input_meta] == [(2, 4)]
    assert [m.shape for m in st.output_meta] == [(2, 3)]
    assert st.submod is st.module


def test_grads_that_do_not_match_their_args_are_refused() -> None:
    with pytest.raises(PipelineUsageError, match=r"output_grads must match output_args"):
        PipelineStage(
            nn.Linear(4, 3),
            0,
            2,
            CPU,
            output_args=torch.zeros(2, 3),
            output_grads=torch.zeros(2, 4),
        )


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("defer_pp_recv", True),
        ("max_active_stages", 2),
        ("unshard_lookahead", "auto"),
        ("backward_requires_autograd", False),
        ("defer_reduce_grad_wait", True),
        ("max_outstanding_sends", 4),
    ],
)
def test_a_torch_executor_option_off_its_default_is_refused_with_the_fix(option, value) -> None:
    with pytest.raises(PipelineUsageError, match=rf"{option}=.*Leave {option} at its default"):
        ScheduleInterleaved1F1B([_stage(0, 4), _stage(2, 4)], 4, **{option: value})


def test_torch_executor_options_at_their_defaults_are_accepted() -> None:
    ScheduleInterleaved1F1B(
        [_stage(0, 4), _stage(2, 4)],
        4,
        defer_pp_recv=False,
        max_active_stages=3,
        unshard_lookahead="full",
        defer_reduce_grad_wait=False,
        max_outstanding_sends=None,
    )


def test_looped_bfs_takes_torchs_positional_order_without_chunk_specs() -> None:
    loss = nn.MSELoss()
    sched = ScheduleLoopedBFS([_stage(0, 4), _stage(2, 4)], 4, loss, None, False)
    assert sched.scale_grads is False


def test_a_chunk_spec_other_than_dim_0_is_refused() -> None:
    with pytest.raises(
        PipelineUsageError, match=r"args_chunk_spec=.*splits every input along dim 0"
    ):
        ScheduleGPipe(_stage(), 4, args_chunk_spec=(TensorChunkSpec(1),))
    ScheduleGPipe(_stage(), 4, args_chunk_spec=(TensorChunkSpec(0),))  # dim 0 is cadence's


def test_kwargs_chunk_spec_is_refused() -> None:
    with pytest.raises(PipelineUsageError, match=r"kwargs_chunk_spec=.*positionally"):
        ScheduleGPipe(_stage(), 4, kwargs_chunk_spec={"mask": TensorChunkSpec(0)})


def test_a_list_of_stages_for_a_single_stage_schedule_is_refused() -> None:
    with pytest.raises(PipelineUsageError, match=r"ScheduleGPipe takes one stage per rank"):
        ScheduleGPipe([_stage()], 4)


def test_something_that_is_not_a_stage_is_refused() -> None:
    with pytest.raises(PipelineUsageError, match=r"expected a PipelineStage, got Linear"):
        ScheduleZBVZeroBubble([nn.Linear(2, 2)], 4)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"mask": torch.ones(2)}, r"keyword inputs \['mask'\]"),
        ({"arg_mbs": [(torch.ones(2),)]}, r"arg_mbs=.*Pass the whole batch"),
        ({"finalize_gradients": False}, r"finalize_gradients=False.*sync_gradients=False"),
    ],
)
def test_step_arguments_cadence_cannot_honour_are_refused_before_any_communication(
    kwargs, named
) -> None:
    sched = ScheduleGPipe(_stage(), 2, loss_fn=nn.MSELoss())
    with pytest.raises(PipelineUsageError, match=named):
        sched.step(torch.ones(2, 4), **kwargs)  # no process group: refused before any


class _MaskedLater(nn.Module):
    """A model whose second half reads a model input (a mask) after the split."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) * mask


def test_a_traced_pipe_whose_later_stage_reads_a_model_input_is_refused() -> None:
    pipe = torch_pipeline(
        _MaskedLater(),
        mb_args=(torch.ones(2, 4), torch.ones(2, 4)),
        split_spec={"b": SplitPoint.BEGINNING},
    )
    with pytest.raises(
        PipelineUsageError, match=r"traced stage 0 reads \[.x.\].*a model input read after stage 0"
    ):
        check_traced_dataflow(pipe.split_gm.graph)


def test_a_sequential_traced_pipe_is_accepted() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    pipe = torch_pipeline(
        model, mb_args=(torch.ones(2, 4),), split_spec={"2": SplitPoint.BEGINNING}
    )
    check_traced_dataflow(pipe.split_gm.graph)
