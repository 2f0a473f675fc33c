"""The learning-rate schedule (see [Note: the learning-rate schedule]).

Specification:
- step ``k`` of ``W`` warmup steps runs at ``lr (k + 1) / W``; the first step after
  the warmup at ``lr``; with ``cosine`` the last step at ``min_lr`` and the rate never
  rises after the warmup; ``constant`` stays at ``lr``;
- torch's scheduler, stepped once per optimizer step, gives those rates exactly.
"""

from __future__ import annotations

import itertools
from typing import Literal

import pytest
import torch

from cadence.train.config import TrainConfig
from cadence.train.lr_schedule import lr_factor, make_scheduler


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_warmup_then_schedule(schedule: Literal["constant", "cosine"]) -> None:
    min_lr = 1e-4 if schedule == "cosine" else None
    cfg = TrainConfig(steps=20, lr=1e-2, warmup_steps=4, lr_schedule=schedule, min_lr=min_lr)
    rates = [cfg.lr * lr_factor(cfg, k) for k in range(cfg.steps)]
    assert rates[:5] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2])
    after = rates[4:]
    if schedule == "constant":
        assert after == [cfg.lr] * len(after)
    else:
        assert after[-1] == pytest.approx(1e-4)
        assert all(a >= b for a, b in itertools.pairwise(after))


def test_torch_scheduler_gives_the_rates() -> None:
    cfg = TrainConfig(steps=10, lr=1e-2, warmup_steps=3, lr_schedule="cosine", min_lr=1e-3)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.lr)
    sched = make_scheduler(opt, cfg)
    seen = []
    for _ in range(cfg.steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == [cfg.lr * lr_factor(cfg, k) for k in range(cfg.steps)]


def test_a_cosine_run_resumes_only_with_its_steps() -> None:
    from cadence.train.lr_schedule import other_steps_problem

    cosine = TrainConfig(steps=20, lr_schedule="cosine")
    assert other_steps_problem(cosine, 20) is None
    assert "resume with --steps 10" in (other_steps_problem(cosine, 10) or "")
    assert other_steps_problem(TrainConfig(steps=20), 10) is None  # constant: extend freely
