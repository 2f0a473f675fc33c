"""Scenarios: cadence's phases appear as named ranges in a ``torch.profiler`` trace.

A user profiling a step with torch's profiler sees FSDP2's and pipelining's own
ranges; cadence's wrappers and pipeline name theirs the same way (``cadence::...``,
`cadence.comm.phase`). Each scenario profiles one step and checks the names it must
show. `SCENARIOS` runs in one world-2 launch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import cadence
from cadence.pipeline.runtime.build import build_pipeline
from tests._scenarios import scenarios


def _ranges(step: Callable[[], None]) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return {e.key for e in prof.key_averages() if e.key.startswith("cadence::")}


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def data_parallel_shows_its_bucket_launches_and_finalize() -> None:
    dp = cadence.DataParallel(_mlp(), bucket_cap_mb=1e-5)
    dp.require_manual_backward_finalization = True

    def step() -> None:
        dp(torch.randn(4, 8)).sum().backward()
        dp.finalize_backward()

    got = _ranges(step)
    assert {"cadence::dp.bucket_launch", "cadence::dp.finalize_wait"} <= got, got


def fully_shard_shows_unshard_reshard_and_reduce_scatter() -> None:
    model = _mlp()
    cadence.fully_shard(model[0])
    cadence.fully_shard(model)
    got = _ranges(lambda: model(torch.randn(4, 8)).sum().backward())
    want = {"cadence::fsdp.unshard", "cadence::fsdp.reshard", "cadence::fsdp.reduce_scatter"}
    assert want <= got, got


def a_pipeline_shows_each_action() -> None:
    torch.manual_seed(0)
    stages = [nn.Linear(8, 8), nn.Linear(8, 1)]
    rt = build_pipeline("1f1b", copy.deepcopy(stages), n_microbatches=2, loss_fn=F.mse_loss)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    got = _ranges(lambda: rt.step(x, target=y))
    assert any(g.startswith("cadence::pp.") and "F" in g for g in got), got
    assert any(g.startswith("cadence::pp.") and "B" in g for g in got), got


SCENARIOS = scenarios(
    data_parallel_shows_its_bucket_launches_and_finalize,
    fully_shard_shows_unshard_reshard_and_reduce_scatter,
    a_pipeline_shows_each_action,
)
