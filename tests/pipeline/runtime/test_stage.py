"""Stage, microbatching and loss policy in one process (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cadence.errors import CadenceError
from cadence.pipeline.runtime import (
    LossPolicy,
    PipelineStateError,
    PipelineUsageError,
    Stage,
    StageShapeError,
    TensorMeta,
    merge_microbatches,
    split_microbatches,
)
from cadence.testing import assert_close, named_grads


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


@pytest.mark.parametrize("first", [False, True])
def test_split_backward_equals_full_backward(first):
    x = torch.randn(4, 8)
    g = torch.randn(4, 8)
    full, split = _mlp(0), _mlp(0)
    a = Stage(full, 0 if first else 1, 3)
    b = Stage(split, 0 if first else 1, 3)
    a.forward(0, (x,))
    b.forward(0, (x,))
    da = a.backward(0, (g,))
    db = b.backward_input(0, (g,))
    if not first:
        assert_close(db, da, atol=0)
        assert all(p.grad is None for p in split.parameters())  # I touches no weight
    b.backward_weight(0)
    assert_close(named_grads(split), named_grads(full), atol=1e-7)


def test_stage_state_errors():
    st = Stage(_mlp(0), 1, 2)
    with pytest.raises(PipelineStateError, match="W without a preceding I"):
        st.backward_weight(3)
    with pytest.raises(PipelineStateError, match="backward without a forward"):
        st.backward(0, (torch.zeros(4, 8),))
    with pytest.raises(PipelineStateError, match="input metadata is not known yet"):
        st.input_buffers()
    with pytest.raises(PipelineUsageError, match=r"stage_index=2 must be in \[0, num_stages=2\)"):
        Stage(_mlp(0), 2, 2)
    with pytest.raises(TypeError, match="must return a tensor or a tuple of tensors, got dict"):
        Stage(_ReturnsDict(), 0, 2).infer_output_meta((torch.zeros(1),))


class _ReturnsDict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict:
        return {"y": x}


def test_shape_checks_on_entry_and_exit():
    st = Stage(_mlp(0), 1, 3, input_meta=TensorMeta((4, 8), torch.float32))
    with pytest.raises(StageShapeError, match=r"got shape \(3, 8\).*expects shape \(4, 8\)"):
        st.forward(0, (torch.randn(3, 8),), how="received")
    st = Stage(_mlp(0), 1, 3, output_meta=TensorMeta((4, 9), torch.float32))
    with pytest.raises(StageShapeError, match="output 0"):
        st.forward(0, (torch.randn(4, 8),))


def test_split_uneven_batch_names_the_fix():
    with pytest.raises(ValueError, match=r"batch size 10.*4 equal microbatches.*multiple of 4"):
        split_microbatches([torch.zeros(10, 3)], 4)
    parts = split_microbatches([torch.arange(8), "flag"], 4)
    assert [p[1] for p in parts] == ["flag"] * 4
    assert torch.equal(merge_microbatches([(p[0],) for p in parts]), torch.arange(8))


def test_loss_policy():
    assert LossPolicy().scale(4) == 0.25
    assert LossPolicy("sum").scale(4) == 1.0
    with pytest.raises(PipelineUsageError, match="use 'mean'"):
        LossPolicy("avg")  # type: ignore[arg-type]


def test_errors_are_cadence_errors_with_builtin_bases():
    from cadence.pipeline.runtime import PipelineRuntimeError, PlanMismatchError
    from cadence.pipeline.schedule import (
        FifoMismatchError,
        ScheduleDeadlockError,
        ScheduleValidationError,
    )

    for cls, base in [
        (PipelineUsageError, ValueError),
        (StageShapeError, ValueError),
        (PipelineStateError, RuntimeError),
        (PlanMismatchError, RuntimeError),
        (PipelineRuntimeError, RuntimeError),
        (ScheduleValidationError, ValueError),
        (FifoMismatchError, ScheduleValidationError),
        (ScheduleDeadlockError, RuntimeError),
    ]:
        assert issubclass(cls, CadenceError) and issubclass(cls, base), cls


class _Tied(nn.Module):
    """A stage with a weight used twice (a tied embedding/head inside one stage) and
    an output that depends on a weight only (no path to the input)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inner = nn.Linear(8, 8)
        self.bias_only = nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = torch.tanh(self.inner(x))
        return self.inner(h) + x, self.bias_only * 2.0


@pytest.mark.parametrize("make", [lambda: _mlp(0), _Tied])
def test_split_backward_fires_each_parameter_hook_once_in_w(make):
    """W accumulates through each parameter's own AccumulateGrad node: its
    post-accumulate hook fires exactly once per W and never in I, which is what
    data-parallel wrappers launch their reductions from."""
    full, split = make(), make()
    x = torch.randn(4, 8)
    fired: dict[str, int] = {}
    for name, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: fired.__setitem__(name, fired.get(name, 0) + 1)
        )
    a, b = Stage(full, 1, 3), Stage(split, 1, 3)
    outs = a.forward(0, (x,))
    b.forward(0, (x,))
    gs = tuple(torch.randn_like(o) for o in outs)
    da = a.backward(0, gs)
    db = b.backward_input(0, gs)
    assert fired == {}
    assert_close(db, da, atol=0)
    kept = b._split[0]
    if isinstance(split, nn.Sequential):  # W re-runs only the two Linears' weight sides
        assert len(kept.groups) == 2 and not kept.residual
    else:  # bias_only never meets the input path: done from the roots
        assert [id(w) for w in kept.residual] == [id(split.bias_only)]
    b.backward_weight(0)
    assert fired == {name: 1 for name, _ in split.named_parameters()}
    assert_close(named_grads(split), named_grads(full), atol=1e-7)


def test_split_backward_part_is_validated():
    from cadence._grad_timing.timing import check_split_part

    with pytest.raises(ValueError, match="must be one of"):
        check_split_part("both", None, ValueError)
    with pytest.raises(ValueError, match="not nested"):
        check_split_part("weight", "input", ValueError)


class _DrawsRandomNumbers(nn.Module):
    """Dropout the functional way (``training`` defaults to True, even in eval) and noise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, 0.5) + torch.rand_like(x)


def test_shape_inference_leaves_the_random_generators_as_it_found_them():
    # See [Note: shape inference draws no random numbers]: every later step must draw
    # the masks the same model draws under torch's pipelining, which infers on meta.
    stage = Stage(_DrawsRandomNumbers(), 1, 2)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert stage.infer_output_meta((torch.zeros(4, 8),)) == (TensorMeta((4, 8), torch.float32),)
    assert torch.equal(torch.get_rng_state(), before)
