"""Scenarios: each DataParallel misuse raises an error naming the cause and the fix.

Each scenario builds its own wrapper (tiny buckets, manual finalization unless it
says otherwise) and asserts what it checks; `SCENARIOS` is run by the world-2 launch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cadence
from cadence.testing import max_abs_diff, named_grads
from tests._outcome import raised
from tests._scenarios import assert_raises, scenarios
from tests.data_parallel.common import TwoHeads, global_batch, local, make_mlp


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, world)
    return local(x, rank, world), local(y, rank, world)


def _fresh(**kw: Any) -> cadence.DataParallel:
    dp = cadence.DataParallel(make_mlp(), bucket_cap_mb=0.002, **kw)
    dp.require_manual_backward_finalization = True
    return dp


def forward_while_pending_raises_before_any_collective() -> None:
    xl, yl = _batch()
    dp = _fresh(broadcast_buffers=True)
    F.mse_loss(dp(xl), yl).backward()
    before = dp.event_log.count()
    assert_raises(lambda: dp(xl), "finalize_backward")
    assert dp.event_log.count() == before, "a collective was issued before the error"
    dp.finalize_backward()


def optimizer_step_while_pending_raises() -> None:
    xl, yl = _batch()
    dp = _fresh(broadcast_buffers=True)
    F.mse_loss(dp(xl), yl).backward()
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    dp.register_optimizer(opt)
    assert_raises(opt.step, "optimizer.step()", "finalize_backward")
    dp.finalize_backward()


def second_synced_backward_while_pending_raises() -> None:
    xl, yl = _batch()
    dp = _fresh(broadcast_buffers=True)
    F.mse_loss(dp(xl), yl).backward()
    dp.finalize_backward()
    l1 = F.mse_loss(dp(xl), yl)
    l1.backward(retain_graph=True)
    assert_raises(lambda: l1.backward(), "finalize_backward")
    dp.finalize_backward()


def finalize_from_a_hook_before_every_bucket_launched_raises() -> None:
    xl, yl = _batch()
    dp = _fresh()
    seen: list[str | None] = []

    class Probe(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            t = t * 1.0
            t.register_hook(
                lambda g: seen.append(
                    raised(lambda: assert_raises(dp.finalize_backward, "buckets have launched"))
                )
            )
            return t

    dp.module.insert(2, Probe())
    F.mse_loss(dp(xl), yl).backward()
    assert seen == [None], f"inside backward: {seen or 'the hook did not run'}"
    dp.finalize_backward()


def _finalize_from_a_hook(
    held: int | None, at: int
) -> tuple[cadence.DataParallel, list[str | None]]:
    """One backward with ``held`` buckets held (None: all) and a hook, before layer
    ``at``, that finalizes; what the hook raised (None: nothing)."""
    xl, yl = _batch()
    xl = xl.clone().requires_grad_()  # the hook needs a graph before the first layer too
    dp = _fresh()
    dp.hold_last_buckets(dp.num_buckets if held is None else held)
    seen: list[str | None] = []

    class Probe(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            t = t * 1.0
            t.register_hook(lambda g: seen.append(raised(dp.finalize_backward)))
            return t

    dp.module.insert(at, Probe())
    dp.event_log.clear()
    F.mse_loss(dp(xl), yl).backward()
    return dp, seen


def finalize_from_a_hook_once_every_held_bucket_is_ready() -> None:
    """Every bucket held, so backward launches none; a hook that runs after the last
    parameter gradient is accumulated (before the first layer: the input's gradient
    comes after the weights') may finalize, and launches them all."""
    dp, seen = _finalize_from_a_hook(held=None, at=0)
    assert dp.num_buckets >= 2, dp.num_buckets
    assert seen == [None], f"inside backward: {seen or 'the hook did not run'}"
    assert dp.event_log.count("all_reduce") == dp.num_buckets, dp.event_log.counts()
    assert dp.finalize_backward() is None  # nothing left pending


def finalize_from_a_hook_before_a_held_bucket_is_ready_raises() -> None:
    """Mid-backward, the held buckets still owe gradients: refused as before."""
    dp, seen = _finalize_from_a_hook(held=1, at=2)
    assert len(seen) == 1 and seen[0] is not None and "buckets have launched" in seen[0], seen
    dp.finalize_backward()


def hold_last_buckets_inside_backward_raises() -> None:
    _in_backward(lambda dp: dp.hold_last_buckets(0), "inside backward")


def _in_backward(action: Any, *fragments: str) -> None:
    """``action`` from a hook inside backward raises an error with ``fragments``."""
    xl, yl = _batch()
    dp = _fresh()
    seen: list[str | None] = []

    class SetterProbe(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            t = t * 1.0
            t.register_hook(
                lambda g: seen.append(raised(lambda: assert_raises(lambda: action(dp), *fragments)))
            )
            return t

    dp.module.insert(2, SetterProbe())
    F.mse_loss(dp(xl), yl).backward()
    dp.finalize_backward()
    assert seen == [None], f"inside backward: {seen or 'the hook did not run'}"


def set_requires_gradient_sync_inside_backward_raises() -> None:
    _in_backward(lambda dp: dp.set_requires_gradient_sync(False), "inside backward")


def set_manual_backward_finalization_inside_backward_raises() -> None:
    _in_backward(lambda dp: dp.set_manual_backward_finalization(False), "inside backward")


def _pending_handle() -> tuple[cadence.DataParallel, Any, torch.Tensor]:
    xl, yl = _batch()
    dp = _fresh()
    F.mse_loss(dp(xl), yl).backward()
    h = dp.finalize_backward(async_op=True)
    assert h is not None, "finalize_backward(async_op=True) returned no handle"
    return dp, h, xl


def second_finalize_before_wait_raises() -> None:
    dp, h, _ = _pending_handle()
    assert_raises(dp.finalize_backward, "wait on the previous")
    h.wait()


def forward_before_wait_raises() -> None:
    dp, h, xl = _pending_handle()
    assert_raises(lambda: dp(xl), "handle.wait()")
    h.wait()


def wait_twice_is_idempotent() -> None:
    dp, h, _ = _pending_handle()
    h.wait()
    g1 = {k: v.clone() for k, v in named_grads(dp).items() if v is not None}
    h.wait()
    g2 = {k: v.clone() for k, v in named_grads(dp).items() if v is not None}
    assert max_abs_diff(g1, g2) == 0, "a second wait changed the gradients"
    assert h.done, "the handle is not done after wait()"


def finalize_with_nothing_pending_returns_none() -> None:
    dp, h, _ = _pending_handle()
    h.wait()
    got = dp.finalize_backward()
    assert got is None, f"returned {got!r}"


def _unused_failed() -> tuple[cadence.DataParallel, torch.Tensor, torch.Tensor]:
    """A wrapper whose backward raised for a parameter without a gradient."""
    xl, yl = _batch()
    dpu = cadence.DataParallel(TwoHeads())
    assert_raises(
        lambda: F.mse_loss(dpu(xl), yl).backward(), "b.weight", "find_unused_parameters=True"
    )
    return dpu, xl, yl


def missing_grad_without_find_unused_raises_instead_of_hanging() -> None:
    _unused_failed()


def forward_after_a_failed_backward_raises_until_reset() -> None:
    dpu, xl, _ = _unused_failed()
    assert_raises(lambda: dpu(xl), "reset_iter_state()")


def reset_iter_state_recovers_after_a_failed_backward() -> None:
    dpu, xl, yl = _unused_failed()
    dpu.reset_iter_state()
    dpu.module.use_b = True
    F.mse_loss(dpu(xl), yl).backward()
    assert dpu.module.a.weight.grad is not None, "no grad after reset"


def models_differing_across_ranks_raise_at_construction() -> None:
    other = make_mlp(depth=4 if dist.get_rank() == 0 else 3)
    assert_raises(lambda: cadence.DataParallel(other), "different parameters")


SCENARIOS = scenarios(
    forward_while_pending_raises_before_any_collective,
    optimizer_step_while_pending_raises,
    second_synced_backward_while_pending_raises,
    finalize_from_a_hook_before_every_bucket_launched_raises,
    finalize_from_a_hook_once_every_held_bucket_is_ready,
    finalize_from_a_hook_before_a_held_bucket_is_ready_raises,
    hold_last_buckets_inside_backward_raises,
    set_requires_gradient_sync_inside_backward_raises,
    set_manual_backward_finalization_inside_backward_raises,
    second_finalize_before_wait_raises,
    forward_before_wait_raises,
    wait_twice_is_idempotent,
    finalize_with_nothing_pending_returns_none,
    missing_grad_without_find_unused_raises_instead_of_hanging,
    forward_after_a_failed_backward_raises_until_reset,
    reset_iter_state_recovers_after_a_failed_backward,
    models_differing_across_ranks_raise_at_construction,
)
