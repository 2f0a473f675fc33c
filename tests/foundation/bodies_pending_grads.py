"""Rank body: before ``finalize_backward()`` nothing can clip, step on or read ``.grad``.

Run for both wrappers (DataParallel and fully_shard) in manual mode, blocking and
async. Each misuse returns "ok" when it raised `UnreducedGradientError` naming
``finalize_backward()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cadence
from cadence._pending_grad import UnreducedGradientError
from cadence.testing import max_abs_diff, run_subtests

__all__ = ["pending_grads_body"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _wrap(kind: str, m: nn.Module) -> nn.Module:
    if kind == "dp":
        return cadence.DataParallel(m)
    for i in (0, 2):
        cadence.fully_shard(m[i])
    return cadence.fully_shard(m)


def _backward(model: nn.Module, step: int = 0) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 1, generator=g)
    F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()


def _raises(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except UnreducedGradientError as exc:
        msg = str(exc)
        return "ok" if "finalize_backward()" in msg and "is not reduced yet" in msg else msg
    return "no error raised"


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def _case(kind: str, mode: str) -> dict[str, Any]:
    auto = _wrap(kind, _model())
    _backward(auto)
    expected = _grads(auto)

    model = _wrap(kind, _model())
    model.require_manual_backward_finalization = True
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)  # no register_optimizer on purpose
    _backward(model)
    handle = model.finalize_backward(async_op=True) if mode == "async" else None
    params = list(model.parameters())
    first = params[0]
    out: dict[str, Any] = {
        "clip": _raises(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)),
        "step": _raises(opt.step),
        "read": _raises(lambda: float(first.grad.norm())),
        "zero_in_place": _raises(lambda: opt.zero_grad(set_to_none=False)),
        "metadata": float(first.grad is not None and first.grad.shape == first.shape),
        "repr": "finalize_backward()" in repr(first.grad),
    }
    if handle is not None:
        handle.wait()
    else:
        model.finalize_backward()
    out["after"] = max_abs_diff(_grads(model), expected)
    out["clip_after"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    opt.step()
    # reset_iter_state gives the local gradients back (the step is being abandoned).
    _backward(model, 1)
    model.reset_iter_state()
    out["after_reset"] = type(first.grad).__name__
    return out


def pending_grads_body() -> dict[str, Any]:
    results = run_subtests(
        {"kind": ["dp", "fsdp"], "mode": ["blocking", "async"]},
        lambda kind, mode: _case(kind, mode),
    )
    return {k.replace("'", ""): v for k, v in results.items()}
