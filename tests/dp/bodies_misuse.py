"""Rank body: one scenario per DataParallel misuse error; each returns "ok" or what went wrong."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cadence
from cadence.testing import max_abs_diff, named_grads
from tests.dp.common import (
    TwoHeads,
    expect_error,
    global_batch,
    local,
    make_mlp,
)


def misuse() -> dict[str, str]:
    """One scenario per misuse error; each returns 'ok' or what went wrong."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, world)
    xl, yl = local(x, rank, world), local(y, rank, world)
    res: dict[str, str] = {}

    def fresh(**kw: Any) -> cadence.DataParallel:
        dp = cadence.DataParallel(make_mlp(), bucket_cap_mb=0.002, **kw)
        dp.require_manual_backward_finalization = True
        return dp

    # Forward while a manual window is pending: raised before any collective.
    dp = fresh(broadcast_buffers=True)
    F.mse_loss(dp(xl), yl).backward()
    before = dp.event_log.count()
    res["forward_pending"] = expect_error(lambda: dp(xl), "finalize_backward")
    if dp.event_log.count() != before:
        res["forward_pending"] = "a collective was issued before the error"
    # optimizer.step() while pending.
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    dp.register_optimizer(opt)
    res["step_pending"] = expect_error(opt.step, "optimizer.step()", "finalize_backward")
    # Second synced backward while pending.
    dp.finalize_backward()
    l1 = F.mse_loss(dp(xl), yl)
    l1.backward(retain_graph=True)
    res["second_backward"] = expect_error(lambda: l1.backward(), "finalize_backward")
    dp.finalize_backward()
    # Finalize from a hook (inside backward) before every bucket launched.
    dp2 = fresh()
    handle_holder: list[str] = []

    class Probe(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            t = t * 1.0
            t.register_hook(
                lambda g: handle_holder.append(
                    expect_error(dp2.finalize_backward, "buckets have launched")
                )
            )
            return t

    dp2.module.insert(2, Probe())
    F.mse_loss(dp2(xl), yl).backward()
    res["finalize_too_early"] = handle_holder[0] if handle_holder else "hook did not run"
    dp2.finalize_backward()
    # Setters during backward.
    dp = fresh()
    msgs: list[str] = []

    class SetterProbe(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            t = t * 1.0
            t.register_hook(
                lambda g: msgs.append(
                    expect_error(lambda: dp.set_requires_gradient_sync(False), "inside backward")
                )
            )
            t.register_hook(
                lambda g: msgs.append(
                    expect_error(
                        lambda: dp.set_manual_backward_finalization(False), "inside backward"
                    )
                )
            )
            return t

    dp.module.insert(2, SetterProbe())
    F.mse_loss(dp(xl), yl).backward()
    dp.finalize_backward()
    res["setter_in_backward"] = msgs[0] if msgs else "hook did not run"
    res["manual_toggle_in_backward"] = msgs[1] if len(msgs) > 1 else "hook did not run"
    # Handle: wait twice is fine; a second finalize before wait raises.
    dp = fresh()
    F.mse_loss(dp(xl), yl).backward()
    h = dp.finalize_backward(async_op=True)
    assert h is not None
    res["second_finalize_before_wait"] = expect_error(dp.finalize_backward, "wait on the previous")
    res["forward_before_wait"] = expect_error(lambda: dp(xl), "handle.wait()")
    h.wait()
    g1 = {k: v.clone() for k, v in named_grads(dp).items() if v is not None}
    h.wait()
    g2 = {k: v.clone() for k, v in named_grads(dp).items() if v is not None}
    res["wait_idempotent"] = "ok" if max_abs_diff(g1, g2) == 0 and h.done else "grads changed"
    res["finalize_nothing_pending"] = (
        "ok" if dp.finalize_backward() is None else "returned a handle"
    )
    # A parameter without a gradient and no find_unused_parameters: error, no hang.
    dpu = cadence.DataParallel(TwoHeads())
    res["missing_grad"] = expect_error(
        lambda: F.mse_loss(dpu(xl), yl).backward(), "b.weight", "find_unused_parameters=True"
    )
    res["failed_state"] = expect_error(lambda: dpu(xl), "reset_iter_state()")
    dpu.reset_iter_state()
    dpu.module.use_b = True
    F.mse_loss(dpu(xl), yl).backward()
    res["after_reset"] = "ok" if dpu.module.a.weight.grad is not None else "no grad after reset"
    # Mismatched models across ranks: clear error at construction.
    other = make_mlp(depth=4 if rank == 0 else 3)
    res["mismatch"] = expect_error(lambda: cadence.DataParallel(other), "different parameters")
    return res
