"""Rank body: the wrappers' ``split_backward`` verb used directly, outside a pipeline."""

from __future__ import annotations

import torch
from torch import nn

import cadence
from cadence import EventLog
from cadence.fsdp import fully_shard
from cadence.pipeline.runtime.split_backward import backward_input
from cadence.testing import max_abs_diff, run_subtests


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))


def _wrap(m: nn.Module, wrapper: str, log: EventLog) -> nn.Module:
    if wrapper == "fully_shard":
        for i in (0, 2):
            fully_shard(m[i], event_log=log)
        return fully_shard(m, event_log=log)
    return cadence.DataParallel(m, event_log=log, bucket_cap_mb=1e-4)  # a bucket per param


def _grads(m: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k.removeprefix("module."): (
            p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        )
        for k, p in m.named_parameters()
    }


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def split_equals_fused(wrapper: str) -> dict:
    """Two microbatches, each I then W, the second W syncing: the same gradients and
    the same reductions (count and order of kinds) as two fused backwards."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(1 + rank)
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(2)]
    out = {}
    for mode in ("fused", "split"):
        log = EventLog()
        model = _wrap(_model(), wrapper, log)
        model.set_manual_backward_finalization(True)
        for k, x in enumerate(xs):
            model.set_requires_gradient_sync(k == 1)
            inp = x.detach().requires_grad_()
            y = model(inp)
            g = torch.ones_like(y)
            if mode == "fused":
                y.backward(g)
                out[f"dx{k}"] = inp.grad
                continue
            with model.split_backward("input"):
                dx, kept = backward_input([y], [g], [inp])
            out[f"dx{k}_split"] = dx[0]
            with model.split_backward("weight"):
                kept.run_weight()
        model.finalize_backward()
        out[mode] = _grads(model)
        out[f"{mode}_kinds"] = [e.kind for e in log.collectives() if e.kind != "all_gather"]
    return {
        "grad_diff": max_abs_diff(out["split"], out["fused"]),
        "dx_diff": max(max_abs_diff(out[f"dx{k}_split"], out[f"dx{k}"]) for k in range(2)),
        "same_reductions": out["split_kinds"] == out["fused_kinds"],
        "n_reductions": len(out["fused_kinds"]),
    }


def misuse(wrapper: str) -> dict:
    model = _wrap(_model(), wrapper, EventLog())
    x = torch.randn(4, 8, requires_grad=True)

    def nested():
        with model.split_backward("input"), model.split_backward("weight"):
            pass

    def inside_backward():
        y = model(x)
        y.register_hook(lambda g: model.split_backward("weight").__enter__())
        y.sum().backward()

    return {
        "bad_part": _error(lambda: model.split_backward("both").__enter__()),
        "nested": _error(nested),
        "inside_backward": _error(inside_backward),
    }


def body() -> dict:
    cadence.init()
    grid = {"wrapper": ["fully_shard", "data_parallel"]}
    return {"parity": run_subtests(grid, split_equals_fused), "misuse": run_subtests(grid, misuse)}
