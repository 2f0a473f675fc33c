"""Stage wrapper, microbatching and loss policy in one process; the failure report."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cadence.pipeline._ops import Op
from cadence.pipeline.microbatch import LossPolicy, merge_microbatches, split_microbatches
from cadence.pipeline.stage import PipelineStage, StageShapeError, TensorMeta
from cadence.testing import assert_close, named_grads, run_distributed


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


@pytest.mark.parametrize("first", [False, True])
def test_split_backward_equals_full_backward(first):
    x = torch.randn(4, 8)
    g = torch.randn(4, 8)
    full, split = _mlp(0), _mlp(0)
    a = PipelineStage(full, 0 if first else 1, 3)
    b = PipelineStage(split, 0 if first else 1, 3)
    a.forward(0, (x,))
    b.forward(0, (x,))
    da = a.backward(0, (g,))
    db = b.backward_input(0, (g,))
    if not first:
        assert_close(db, da, atol=0)
        assert all(p.grad is None for p in split.parameters())  # I touches no weight
    b.backward_weight(0)
    assert_close(named_grads(split), named_grads(full), atol=1e-7)


def test_w_without_i_is_an_error():
    st = PipelineStage(_mlp(0), 1, 2)
    with pytest.raises(RuntimeError, match="W without a preceding I"):
        st.backward_weight(3)


def test_shape_checks_on_entry_and_exit():
    st = PipelineStage(_mlp(0), 1, 3, input_meta=TensorMeta((4, 8), torch.float32))
    with pytest.raises(StageShapeError, match=r"got shape \(3, 8\).*expects shape \(4, 8\)"):
        st.forward(0, (torch.randn(3, 8),), how="received")
    st = PipelineStage(_mlp(0), 1, 3, output_meta=TensorMeta((4, 9), torch.float32))
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
    with pytest.raises(ValueError, match="use 'mean'"):
        LossPolicy("avg")  # type: ignore[arg-type]


def body_error_report():
    """A one-rank pipeline whose second stage is given the wrong metadata."""
    from cadence.pipeline.runtime import PipelineRuntime, PipelineRuntimeError

    stages = [
        PipelineStage(_mlp(0), 0, 2),
        PipelineStage(
            _mlp(1),
            1,
            2,
            input_meta=TensorMeta((2, 7), torch.float32),
            output_meta=TensorMeta((2, 8), torch.float32),
        ),
    ]
    ops = {
        0: [
            Op("F", 0, 0),
            Op("LOCAL", 0, 0, peer_stage=1),
            Op("F", 1, 0),
            Op("B", 1, 0),
            Op("LOCAL", 1, 0, peer_stage=0, grad=True),
            Op("B", 0, 0),
        ]
    }
    stages[0].output_meta = (TensorMeta((2, 8), torch.float32),)
    rt = PipelineRuntime(ops, {0: 0, 1: 0}, 1, stages, loss_fn=lambda o, t: (o - t).pow(2).mean())
    try:
        rt.step(torch.randn(2, 8), target=torch.randn(2, 8))
    except PipelineRuntimeError as e:
        return str(e), e.index
    return "no error", -1


def test_failure_reports_the_schedule_with_the_action_marked():
    [(msg, index)] = run_distributed(body_error_report, world_size=1, timeout=30)
    assert index == 2
    lines = msg.splitlines()
    assert "failed at action 2 (1F0)" in lines[0] and "StageShapeError" in lines[0]
    marked = [ln for ln in lines if "<-- ERROR HERE" in ln]
    assert len(marked) == 1 and "1F0" in marked[0]
    assert (
        sum(1 for ln in lines if ln.strip().startswith(("0 ", "1 ", "2 ", "3 ", "4 ", "5 "))) == 6
    )
