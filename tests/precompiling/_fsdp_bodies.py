"""Rank body: precompile_module on fully_shard models (dynamic FullyShard<Cls> classes)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import cadence
from cadence.comm import EventLog
from cadence.fsdp import FullyShardError
from cadence.precompiling import PrecompileUsageError, precompile, precompile_module, stats
from cadence.testing import max_abs_diff, shard
from tests.precompiling._bodies import BACKEND, inputs, step

__all__ = ["fully_shard_body"]

STEPS = 3


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


def _train(
    model: torch.nn.Module, eager: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
) -> dict[str, Any]:
    """STEPS SGD steps of both models: per-step loss and grad differences, final params."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    losses, loss_diffs, grad_diffs = [], [], []
    for _ in range(STEPS):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        eager_loss = F.mse_loss(eager(x), y)
        eager_loss.backward()
        losses.append(loss.item())
        loss_diffs.append(abs(loss.item() - eager_loss.item()))
        grad_diffs.append(max_abs_diff(_full_grads(model), _full_grads(eager)))
        for o in (opt, eager_opt):
            o.step()
            o.zero_grad()
    return {
        "losses": losses,
        "loss_diffs": loss_diffs,
        "grad_diffs": grad_diffs,
        "param_diff": max_abs_diff(_full(model), _full(eager)),
    }


def _refused(fn: Any, *args: Any, error: type[Exception] = PrecompileUsageError) -> str:
    try:
        fn(*args)
    except error as exc:
        return str(exc)
    return "not refused"


def _mid_step_refusals(eager: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, str]:
    """precompile_module on a unit in the middle of a step: refused before any collective."""
    out: dict[str, str] = {}

    def during_forward(*_: Any) -> None:
        out["during_forward"] = _refused(precompile_module, eager, (x,), error=FullyShardError)

    hook = eager.a.register_forward_pre_hook(during_forward)
    eager.set_manual_backward_finalization(True)
    F.mse_loss(eager(x), y).backward()
    hook.remove()
    handle = eager.finalize_backward(async_op=True)
    out["pending_handle"] = _refused(precompile_module, eager, (x,), error=FullyShardError)
    handle.wait()
    eager.set_manual_backward_finalization(False)
    return out


def _root_only(cache_dir: str, rank: int, world: int) -> dict[str, Any]:
    model, x_all, y_all = inputs(batch=4 * world)
    eager = copy.deepcopy(model)
    for m in (model, eager):
        cadence.fully_shard(m)
    x, y = shard(x_all, rank, world), shard(y_all, rank, world)
    log = EventLog()
    before = stats()["compiles"]
    # No model.unshard() first: precompile_module holds the unit unsharded for the
    # compile and leaves it sharded, so the optimizer below gets the sharded params.
    compiled = precompile_module(model, (x,), cache_dir=cache_dir, backend=BACKEND, event_log=log)
    out: dict[str, Any] = {
        "compiles": stats()["compiles"] - before,
        "source": compiled.source,
        "class": type(model).__qualname__,
        "sharded_after": all(isinstance(p, DTensor) for p in model.parameters()),
        # precompile(step, (model, ...)) would call the model's hooks inside the graph.
        "call_refusal": _refused(precompile, step, (model, x, y)),
    }
    out.update(_train(model, eager, x, y))
    out.update(_mid_step_refusals(eager, x, y))
    return out


def _nested(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(1)
    model = Stack()
    eager = copy.deepcopy(model)
    for m in (model, eager):
        for block in m.blocks:
            cadence.fully_shard(block)
        cadence.fully_shard(m)
    x_all, y_all = torch.randn(4 * world, 4), torch.randn(4 * world, 2)
    x, y = shard(x_all, rank, world), shard(y_all, rank, world)
    out: dict[str, Any] = {
        "root_refusal": _refused(precompile_module, model, (x,)),
        # A plain container of units, passed to a function that calls it.
        "container_refusal": _refused(precompile, step, (torch.nn.Sequential(model), x, y), None),
    }
    # The blocks' input: the root's first layer's output, which requires grad.
    h = torch.randn(x.shape[0], 8, requires_grad=True)
    before = stats()["compiles"]
    for block in model.blocks:
        precompile_module(block, (h,), backend=BACKEND)
    out["block_compiles"] = stats()["compiles"] - before
    out.update(_train(model, eager, x, y))
    return out


def fully_shard_body(cache_dir: str) -> dict[str, Any]:
    """precompile_module on a fully_shard root and on nested units: eager parity."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return {"root": _root_only(cache_dir, rank, world), "nested": _nested(rank, world)}
