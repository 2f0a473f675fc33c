"""``--clip-grad-norm``: the norm clipped by is the whole model's, on every layout.

Specification:
- the norm `GradClipper` computes each step is the global norm of the whole model's
  gradient: equal (within 1e-5 relative at the first step, before any update) to the
  norm torch's ``clip_grad_norm_`` finds in one process training the same model on
  the whole global batch, for DataParallel, fully_shard, HSDP (2 x 2), a pipeline,
  and a pipeline of DataParallel or fully_shard stages (pp 2 x dp 2);
- with clipping on (every step clips), the losses of every layout follow the
  one-process run's (within 1e-4 relative: only the order of float sums differs);
- the learning rate of each step is the schedule's (warmup, then cosine), on every
  layout.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from cadence.models.gpt import TinyGPT
from cadence.testing import run_distributed
from cadence.train.build import loss_fn, make_data
from cadence.train.lr_schedule import lr_factor, make_scheduler
from tests.train.bodies_clip import BASE, body_clip


def _one_process() -> dict[str, list[float]]:
    """BASE trained in this process on the whole batch, clipped by torch."""
    cfg = BASE
    torch.manual_seed(cfg.seed)
    model = TinyGPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sched = make_scheduler(opt, cfg)
    data = make_data(cfg)
    out: dict[str, list[float]] = {"norms": [], "losses": [], "lrs": []}
    assert cfg.clip_grad_norm is not None
    for step in range(cfg.steps):
        x, y = data.batch(step, cfg.batch_size)
        loss = loss_fn(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
        out["norms"].append(float(norm))
        out["lrs"].append(float(opt.param_groups[0]["lr"]))
        out["losses"].append(float(loss.detach()))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, list[float]]:
    with torch.random.fork_rng():
        return _one_process()


def _check(results: list[dict[str, Any]], ref: dict[str, list[float]]) -> None:
    assert all(n > BASE.clip_grad_norm for n in ref["norms"])  # type: ignore[operator]
    for r in results:
        assert len(r["norms"]) == BASE.steps
        assert math.isclose(r["norms"][0], ref["norms"][0], rel_tol=1e-5)
        for got, want in zip(r["norms"], ref["norms"], strict=True):
            assert math.isclose(got, want, rel_tol=1e-4)
        for got, want in zip(r["losses"], ref["losses"], strict=True):
            assert math.isclose(got, want, rel_tol=1e-4)
        assert r["lrs"] == ref["lrs"]
    expected = [BASE.lr * lr_factor(BASE, k) for k in range(BASE.steps)]
    assert [math.isclose(a, b, rel_tol=1e-12) for a, b in zip(ref["lrs"], expected)] == [
        True
    ] * BASE.steps


@pytest.mark.parametrize(
    "flags",
    [{}, {"fsdp": True}, {"pp": 2}],
    ids=["dp2", "fsdp2", "pp2"],
)
def test_global_norm_world2(flags: dict[str, Any], reference: dict[str, list[float]]) -> None:
    _check(run_distributed(body_clip, flags, world_size=2, timeout=150), reference)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [{"pp": 2}, {"pp": 2, "fsdp": True}, {"fsdp": True, "dp_replicate": 2}],
    ids=["pp2xdp2", "pp2xfsdp2", "hsdp2x2"],
)
def test_global_norm_world4(flags: dict[str, Any], reference: dict[str, list[float]]) -> None:
    _check(run_distributed(body_clip, flags, world_size=4, timeout=200), reference)
