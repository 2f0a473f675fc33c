"""Scenarios: before ``finalize_backward()`` nothing can clip, step on or read ``.grad``.

Run for both wrappers (DataParallel and fully_shard) in manual mode, blocking and
async. Each misuse must raise `UnreducedGradientError` naming ``finalize_backward()``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cadence
from cadence.errors import UnreducedGradientError
from cadence.testing import max_abs_diff
from tests._outcome import raised
from tests._scenarios import Scenario, assert_raises

__all__ = ["SCENARIOS"]


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


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def _pending(kind: str, mode: str) -> tuple[nn.Module, torch.optim.Optimizer, Any, dict]:
    """A manual-mode model whose gradients are not reduced yet; the handle if async; and
    the gradients automatic finalization gives."""
    auto = _wrap(kind, _model())
    _backward(auto)
    expected = _grads(auto)

    model = _wrap(kind, _model())
    model.require_manual_backward_finalization = True
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)  # no register_optimizer on purpose
    _backward(model)
    handle = model.finalize_backward(async_op=True) if mode == "async" else None
    return model, opt, handle, expected


def _finalize(model: nn.Module, handle: Any) -> None:
    if handle is not None:
        handle.wait()
    else:
        model.finalize_backward()


def _misuses(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    first = next(iter(model.parameters()))
    return {
        "clip": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
        "step": opt.step,
        "read": lambda: float(first.grad.norm()),
        "zero_in_place": lambda: opt.zero_grad(set_to_none=False),
    }


def misuse_names_finalize_backward(kind: str, mode: str, misuse: str) -> None:
    model, opt, handle, _ = _pending(kind, mode)
    assert_raises(
        _misuses(model, opt)[misuse],
        "finalize_backward()",
        "is not reduced yet",
        kind=UnreducedGradientError,
    )
    _finalize(model, handle)


def grads_after_finalize_are_the_reduced_ones(kind: str, mode: str) -> None:
    model, opt, handle, expected = _pending(kind, mode)
    for misuse in _misuses(model, opt).values():
        raised(misuse)  # each refused (checked by its own scenario), changing nothing
    first = next(iter(model.parameters()))
    # Shape and `is None` checks still work, and the repr says why.
    assert first.grad is not None and first.grad.shape == first.shape, "metadata"
    assert "finalize_backward()" in repr(first.grad), repr(first.grad)
    _finalize(model, handle)
    after = max_abs_diff(_grads(model), expected)
    assert after < 1e-6, f"differs from automatic finalization by {after:.3e}"
    clip_after = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    assert clip_after > 0, clip_after
    opt.step()
    # reset_iter_state gives the local gradients back (the step is being abandoned).
    _backward(model, 1)
    model.reset_iter_state()
    assert type(first.grad).__name__ != "PendingGrad", type(first.grad)


CASES = [(k, m) for k in ("dp", "fsdp") for m in ("blocking", "async")]
SCENARIOS = [
    *(
        Scenario(
            f"misuse_names_finalize_backward-{k}-{m}-{misuse}",
            misuse_names_finalize_backward,
            {"kind": k, "mode": m, "misuse": misuse},
        )
        for k, m in CASES
        for misuse in ("clip", "step", "read", "zero_in_place")
    ),
    *(
        Scenario(
            f"grads_after_finalize_are_the_reduced_ones-{k}-{m}",
            grads_after_finalize_are_the_reduced_ones,
            {"kind": k, "mode": m},
        )
        for k, m in CASES
    ),
]
