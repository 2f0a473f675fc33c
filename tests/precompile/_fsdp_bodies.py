"""Rank body: precompile_module on a fully_shard model (dynamic FullyShard<Cls> classes)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cadence
from cadence.comm import EventLog
from cadence.precompile import precompile_module, stats
from cadence.testing import max_abs_diff, shard
from tests.precompile._bodies import BACKEND, inputs

__all__ = ["fully_shard_body"]


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        out[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


def fully_shard_body(cache_dir: str) -> dict[str, Any]:
    """Precompile a fully_shard model's forward: one compile, received by rank 1, eager parity."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, x_all, y_all = inputs(batch=4 * world)
    eager = copy.deepcopy(model)
    for m in (model, eager):
        cadence.fully_shard(m)
    x, y = shard(x_all, rank, world), shard(y_all, rank, world)
    log = EventLog()
    # Trace with the parameters unsharded, as the forward runs them (the root keeps
    # them unsharded between forward and backward: reshard_after_forward is False).
    model.unshard()
    before = stats()["compiles"]
    compiled = precompile_module(model, (x,), cache_dir=cache_dir, backend=BACKEND, event_log=log)
    out: dict[str, Any] = {
        "compiles": stats()["compiles"] - before,
        "source": compiled.source,
        "class": type(model).__qualname__,
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    diffs = []
    for _ in range(2):
        F.mse_loss(model(x), y).backward()
        F.mse_loss(eager(x), y).backward()
        diffs.append(max_abs_diff(_full_grads(model), _full_grads(eager)))
        opt.step()
        eager_opt.step()
        opt.zero_grad()
        eager_opt.zero_grad()
    out["grad_diffs"] = diffs
    out["param_diff"] = max_abs_diff(_full(model), _full(eager))
    return out
