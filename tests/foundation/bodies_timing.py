"""Rank body: the gradient-timing verbs behave the same on DataParallel and fully_shard.

One body, run for each wrapper (`run_subtests`), checks every verb of
`cadence.GradientTiming` by event order and collective counts; see
[Note: one set of timing verbs] in ``cadence/_grad_timing/timing.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import cadence
from cadence._grad_timing.timing import ShardedTiming
from cadence.testing import max_abs_diff, run_subtests

__all__ = ["WRAPPERS", "timing_verbs"]

WRAPPERS = ["dp", "fsdp"]
_LR = 0.1


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


class _Wrapped:
    """A wrapped MLP, the collective its reductions use and how many one step issues."""

    def __init__(self, wrapper: str) -> None:
        self.log = cadence.EventLog()
        model = _mlp()
        if wrapper == "dp":
            # One parameter per bucket: several reductions launch during backward.
            self.module: Any = cadence.DataParallel(
                model, bucket_cap_mb=1e-5, first_bucket_cap_mb=None, event_log=self.log
            )
            self.kind = "all_reduce"
            self.reductions = self.module.num_buckets
        else:
            cadence.fully_shard(model[0], event_log=self.log)
            cadence.fully_shard(model[2], event_log=self.log)
            self.module = cadence.fully_shard(model, event_log=self.log)
            self.kind = "reduce_scatter"
            self.reductions = 3
        self.inner: nn.Sequential = getattr(self.module, "module", self.module)
        self.log.clear()

    def count(self) -> int:
        return self.log.count(self.kind)

    def dense_params(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.module.named_parameters():
            t = p.full_tensor() if isinstance(p, DTensor) else p
            out[name.removeprefix("module.")] = t.detach().clone()
        return out


def _error(fn: Callable[[], object]) -> str:
    """``"<class>: <message>"`` of a CadenceError raised by ``fn`` (which must be a RuntimeError)."""
    try:
        fn()
    except cadence.CadenceError as exc:
        kind = "RuntimeError" if isinstance(exc, RuntimeError) else "not a RuntimeError"
        return f"{kind}: {exc}"
    return "no error"


def _reference_step(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    ref = _mlp()
    F.mse_loss(ref(torch.tanh(x)), y).backward()
    torch.optim.SGD(ref.parameters(), lr=_LR).step()
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


def _finalize_in_backward(wrapper: str, manual: bool) -> dict[str, Any]:
    """The optimizer-in-backward pattern: a hook upstream of the wrapped module finalizes
    and steps while backward still runs (see [Note: finalize inside backward])."""
    rank, world = dist.get_rank(), dist.get_world_size()
    w = _Wrapped(wrapper)
    w.module.set_manual_backward_finalization(manual)
    opt = torch.optim.SGD(w.module.parameters(), lr=_LR)
    w.module.register_optimizer(opt)
    x, y = _batch(rank)
    x.requires_grad_()
    seen: dict[str, Any] = {}

    def hook(grad: torch.Tensor) -> None:
        seen["issued_before_hook"] = w.count()
        seen["finalize"] = w.module.finalize_backward()
        opt.step()  # the guard lets it through: the gradients are the reduced ones
        w.log.mark("step_in_backward")

    h = torch.tanh(x)  # the "sparse" part: its backward still runs after the hook
    h.register_hook(hook)
    F.mse_loss(w.module(h), y).backward()
    w.log.mark("backward_end")
    xs, ys = zip(*(_batch(r) for r in range(world)))
    expected = _reference_step(torch.cat(xs), torch.cat(ys))
    step, end = w.log.marks("step_in_backward"), w.log.marks("backward_end")
    reductions = w.log.collectives(w.kind)
    return {
        "reductions": len(reductions),
        "expected_reductions": w.reductions,
        "issued_before_hook": seen.get("issued_before_hook"),
        "finalize_returned": repr(seen.get("finalize", "hook did not run")),
        "waited_before_step": all(
            e.wait_end_t is not None and e.wait_end_t <= step[0].issue_t for e in reductions
        ),
        "step_before_backward_end": step[0].seq < end[0].seq,
        "param_diff": max_abs_diff(w.dense_params(), expected),
        # Nothing left for the end of backward or a later finalize.
        "finalize_after": repr(w.module.finalize_backward()),
        "reductions_after": w.count(),
    }


def _finalize_too_early(wrapper: str) -> dict[str, Any]:
    """A hook inside the wrapped module fires before every reduction launched: refused."""
    w = _Wrapped(wrapper)
    w.module.set_manual_backward_finalization(True)
    messages: list[str] = []

    def attach(_m: Any, _i: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda g: messages.append(_error(w.module.finalize_backward)))

    w.inner[0].register_forward_hook(attach)
    x, y = _batch(dist.get_rank())
    F.mse_loss(w.module(x), y).backward()
    during = w.count()
    w.module.finalize_backward()  # after backward it completes, with no extra reduction
    return {"messages": messages, "reductions": [during, w.count()], "expected": w.reductions}


def _nothing_pending(wrapper: str) -> dict[str, Any]:
    w = _Wrapped(wrapper)
    w.module.set_manual_backward_finalization(True)
    blocking = w.module.finalize_backward()
    handle = w.module.finalize_backward(async_op=True)
    return {
        "blocking": repr(blocking),
        "async_type": type(handle).__name__,
        "async_done": bool(handle is not None and handle.done),
        "collectives": w.log.count(),
    }


def _setters_inside_backward(wrapper: str) -> dict[str, Any]:
    w = _Wrapped(wrapper)
    found: dict[str, str] = {}

    def hook(grad: torch.Tensor) -> None:
        found["sync"] = _error(lambda: w.module.set_requires_gradient_sync(False))
        found["manual"] = _error(lambda: w.module.set_manual_backward_finalization(True))

    x, y = _batch(dist.get_rank())
    out = w.module(x)
    out.register_hook(hook)
    F.mse_loss(out, y).backward()
    # The refused setters changed nothing: this backward synced in automatic mode.
    found["reductions"] = str(w.count())
    found["manual_after"] = str(w.module.require_manual_backward_finalization)
    return found


def _sync_flags(wrapper: str) -> dict[str, Any]:
    w = _Wrapped(wrapper)
    x, y = _batch(dist.get_rank())
    out: dict[str, Any] = {}
    w.module.set_manual_backward_finalization(True)
    F.mse_loss(w.module(x), y).backward()
    out["should_manual_sync"] = w.module.should_finalize_after_backward
    w.module.finalize_backward()
    w.module.set_requires_gradient_sync(False, recurse=True)
    w.log.clear()
    F.mse_loss(w.module(x), y).backward()
    out["should_manual_nosync"] = w.module.should_finalize_after_backward
    out["nosync_reductions"] = w.count()
    # Sync back on: the owed (deferred) reduction is paid once by finalize.
    w.module.set_requires_gradient_sync(True)
    handle = w.module.finalize_backward(async_op=True)
    handle.wait()
    out["deferred_reductions"] = w.count()
    out["expected"] = w.reductions
    w.module.set_manual_backward_finalization(False)
    out["should_auto"] = w.module.should_finalize_after_backward
    return out


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def _optimizer_guard_and_reset(wrapper: str) -> dict[str, Any]:
    w = _Wrapped(wrapper)
    opt = torch.optim.SGD(w.module.parameters(), lr=_LR)
    w.module.register_optimizer(opt)
    x, y = _batch(dist.get_rank())
    out: dict[str, Any] = {}
    w.module.set_manual_backward_finalization(True)
    F.mse_loss(w.module(x), y).backward()
    out["step_unfinalized"] = _error(opt.step)
    handle = w.module.finalize_backward(async_op=True)
    out["step_unwaited"] = _error(opt.step)
    handle.wait()
    opt.step()
    # A backward that raises inside the wrapped module, after some reductions launched.
    w.module.set_manual_backward_finalization(False)
    boom = w.inner[2].register_forward_hook(lambda m, i, o: _Boom.apply(o))
    try:
        F.mse_loss(w.module(x), y).backward()
    except RuntimeError as exc:
        out["backward_raised"] = str(exc)
    boom.remove()
    out["step_after_failure"] = _error(opt.step)
    out["forward_after_failure"] = _error(lambda: w.module(x))
    w.module.reset_iter_state()
    w.log.clear()
    F.mse_loss(w.module(x), y).backward()
    opt.step()
    out["reductions_after_reset"] = w.count()
    out["expected"] = w.reductions
    return out


def _case(wrapper: str) -> dict[str, Any]:
    return {
        "is_gradient_timing": isinstance(_Wrapped(wrapper).module, cadence.GradientTiming),
        "is_sharded_timing": isinstance(_Wrapped(wrapper).module, ShardedTiming),
        "in_backward_auto": _finalize_in_backward(wrapper, manual=False),
        "in_backward_manual": _finalize_in_backward(wrapper, manual=True),
        "too_early": _finalize_too_early(wrapper),
        "nothing_pending": _nothing_pending(wrapper),
        "setters": _setters_inside_backward(wrapper),
        "flags": _sync_flags(wrapper),
        "guard": _optimizer_guard_and_reset(wrapper),
    }


def timing_verbs() -> dict[str, Any]:
    return run_subtests({"wrapper": WRAPPERS}, _case)
