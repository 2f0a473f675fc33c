"""Rank body: `cadence.gradient_timing` drives torch's own FSDP2 and DDP modules."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import cadence
from cadence.pipeline.runtime.grad_sync import StageGradSync
from cadence.testing import max_abs_diff
from tests.dp.common import expect_error as _error
from tests.fsdp.bodies_parity import _Counter
from tests.fsdp.common import (
    apply_torch,
    full_params,
    loss_fn,
    make_batches,
    make_blocks,
    reference_steps,
)

__all__ = ["torch_timing_body"]


def _fsdp2(rank: int, world: int) -> dict[str, Any]:
    batches = make_batches("blocks", 2, 8)
    ref = reference_steps(make_blocks(), batches)
    m = make_blocks()
    apply_torch(m, m.units())
    timing = cadence.gradient_timing(m)
    out: dict[str, Any] = {"is_timing": isinstance(timing, cadence.GradientTiming)}
    timing.set_manual_backward_finalization(True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    timing.register_optimizer(opt)
    counts = []
    with _Counter() as counter:
        for batch in batches:
            for i, mb in enumerate(batch.chunk(world)[rank].chunk(2)):
                loss = loss_fn(m, mb) / 2
                timing.set_requires_gradient_sync(i == 1)  # after forward, as pipelines do
                loss.backward()
                counts.append(counter.take()[1])
            handle = timing.finalize_backward(async_op=True)
            handle.wait()
            opt.step()
            opt.zero_grad()
    out["rs_per_micro"] = counts
    out["parity"] = max_abs_diff(full_params(m), ref)
    # The deferred reduction (sync off for every backward) is what torch 2.13 cannot do.
    timing.set_requires_gradient_sync(False)
    loss_fn(m, batches[0].chunk(world)[rank]).backward()
    timing.set_requires_gradient_sync(True)
    out["deferred"] = _error(
        lambda: timing.finalize_backward(), "accumulated with sync off", "before the last"
    )
    out["deferred_step"] = _error(opt.step, "never reduced")
    timing.reset_iter_state()
    opt.zero_grad()
    return out


def _ddp(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    calls: list[int] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # torch checks annotations
        calls.append(1)
        return default_hooks.allreduce_hook(None, bucket)

    ddp = DDP(copy.deepcopy(base))
    ddp.register_comm_hook(None, hook)
    ours = cadence.DataParallel(copy.deepcopy(base))
    timings = [cadence.gradient_timing(ddp), cadence.gradient_timing(ours)]
    out: dict[str, Any] = {"ours_is_itself": timings[1] is ours}
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8 * world, 8, generator=g), torch.randn(8 * world, 1, generator=g)
    for model, timing in zip((ddp, ours), timings):
        for i, (xb, yb) in enumerate(
            zip(x.chunk(world)[rank].chunk(2), y.chunk(world)[rank].chunk(2))
        ):
            timing.set_requires_gradient_sync(i == 1)  # before forward: DDP decides there
            (F.mse_loss(model(xb), yb) / 2).backward()
        timing.finalize_backward()
    out["ddp_all_reduces"] = len(calls)
    out["parity"] = max_abs_diff(
        {n: p.grad for n, p in ddp.named_parameters()},
        {n: p.grad for n, p in ours.named_parameters()},
    )
    # The decision is taken when the backward starts, as on cadence's wrappers: a
    # flag turned off after the forward keeps that backward local...
    xr, yr = x.chunk(world)[rank], y.chunk(world)[rank]
    calls.clear()
    loss = F.mse_loss(ddp(xr), yr)
    timings[0].set_requires_gradient_sync(False)
    loss.backward()
    out["off_after_forward_all_reduces"] = len(calls)
    # ... and turned back on before the next backward, that one reduces (both).
    loss = F.mse_loss(ddp(xr), yr)
    timings[0].set_requires_gradient_sync(True)
    loss.backward()
    out["on_after_forward_all_reduces"] = len(calls)
    # DDP's own no_sync() is still honoured (decided at its forward, as DDP does).
    with ddp.no_sync():
        loss = F.mse_loss(ddp(xr), yr)
    loss.backward()
    out["no_sync_all_reduces"] = len(calls) - 1
    out["flag_restored"] = ddp.require_backward_grad_sync
    # static_graph: DDP's first iterations need the decision at forward; a flip refused.
    static = DDP(copy.deepcopy(base), static_graph=True)
    st = cadence.gradient_timing(static)
    loss = F.mse_loss(static(xr), yr)
    out["flip_after_forward"] = _error(
        lambda: st.set_requires_gradient_sync(False), "set it before the forward"
    )
    loss.backward()
    # Zero-bubble split backwards: refused by the adapter, and up front by the pipeline.
    out["split"] = _error(
        lambda: timings[0].split_backward("input"), "every autograd call", "cadence.DataParallel"
    )
    out["split_refusal"] = [StageGradSync(m).split_refusal() for m in (ddp, ours)]
    return out


def torch_timing_body() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    return {"fsdp2": _fsdp2(rank, world), "ddp": _ddp(rank, world)}
