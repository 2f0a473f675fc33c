"""Rank body: `cadence.gradient_timing` drives torch's own FSDP2 and DDP modules.

The body makes the same calls on every torch and records what each raised
(`tests._outcome.raised`: ``None`` when it returned, a cadence refusal's message, or
a torch error that escaped), what it returned, and the collectives it issued;
`test_torch_timing.py` holds the expectations, chosen by whether torch has
caller-side finalization ([Note: driving torch's wrappers with the timing verbs] in
``cadence/_grad_timing/torch_timing.py``). Collectives are counted to show *when* reductions
run: reduce-scatters for FSDP2, calls of a DDP comm hook (one per bucket) for DDP.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

import cadence
from cadence.comm import ReductionHandle
from cadence.pipeline.runtime.grad_sync import StageGradSync
from cadence.testing import max_abs_diff
from tests._outcome import raised
from tests.fsdp.bodies_parity import _Counter
from tests.fsdp.common import (
    apply_torch,
    full_params,
    loss_fn,
    make_batches,
    make_blocks,
    reference_steps,
)

__all__ = ["TORCH_DDP_FINALIZES", "TORCH_FSDP2_FINALIZES", "torch_timing_body"]

# Capabilities read from torch itself (not from the adapter), so a wrong detection
# in the adapter shows up as a test failure rather than choosing the expectations.
TORCH_DDP_FINALIZES = hasattr(DDP, "finalize_backward")
TORCH_FSDP2_FINALIZES = hasattr(FSDPModule, "set_manual_backward_finalization")


def _finalize(timing: Any, got: list[Any], *, async_op: bool = False) -> Callable[[], None]:
    """``finalize_backward`` for `raised`, keeping what it returned in ``got``."""
    return lambda: got.append(timing.finalize_backward(async_op=async_op))


def _finalize_both(timing: Any, got: list[Any]) -> None:
    """A blocking then an async ``finalize_backward``, what they returned into ``got``."""
    _finalize(timing, got)()
    _finalize(timing, got, async_op=True)()


# -- FSDP2 ---------------------------------------------------------------------


def _fsdp2_model() -> nn.Module:
    m = make_blocks()
    apply_torch(m, m.units())  # 3 blocks and the root: 4 reduce-scatters per reduction
    return m


def _fsdp2_flags_after_forward(rank: int, world: int) -> dict[str, Any]:
    """Manual mode, the sync flag set after each forward (as pipelines do), async finalize."""
    batches = make_batches("blocks", 2, 8)
    ref = reference_steps(make_blocks(), batches)
    m = _fsdp2_model()
    timing = cadence.gradient_timing(m)
    out: dict[str, Any] = {
        "is_timing": isinstance(timing, cadence.GradientTiming),
        "native": getattr(timing, "native_finalization", None),
    }
    timing.set_manual_backward_finalization(True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    timing.register_optimizer(opt)
    counts, pending, done = [], [], []
    with _Counter() as counter:
        for batch in batches:
            step = []
            for i, mb in enumerate(batch.chunk(world)[rank].chunk(2)):
                loss = loss_fn(m, mb) / 2
                timing.set_requires_gradient_sync(i == 1)
                loss.backward()
                step.append(counter.take()[1])
            handle = timing.finalize_backward(async_op=True)
            step.append(counter.take()[1])
            pending.append(not handle.done)
            handle.wait()
            done.append(handle.done)
            counts.append(step)
            opt.step()
            opt.zero_grad()
    out["rs"] = counts  # per step: [micro 0 backward, micro 1 backward, finalize]
    out["pending_at_return"] = pending
    out["done_after_wait"] = done
    out["parity"] = max_abs_diff(full_params(m), ref)
    return out


def _fsdp2_deferred(rank: int, world: int) -> dict[str, Any]:
    """Every backward with sync off, then sync on and finalize: the deferred reduction.
    Step 0 in manual mode with an async handle, then automatic mode: blocking, async."""
    batches = make_batches("blocks", 3, 8)
    ref = reference_steps(make_blocks(), batches)
    m = _fsdp2_model()
    timing = cadence.gradient_timing(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    timing.register_optimizer(opt)
    out: dict[str, Any] = {"rs": [], "finalize": []}
    with _Counter() as counter:
        for step, batch in enumerate(batches):
            manual, async_op = step == 0, step != 1
            timing.set_manual_backward_finalization(manual)
            timing.set_requires_gradient_sync(False)
            micro = batch.chunk(world)[rank].chunk(2)
            for mb in micro:
                (loss_fn(m, mb) / 2).backward()
            timing.set_requires_gradient_sync(True)
            before = counter.take()[1]
            got: list[Any] = []
            out["finalize"].append(raised(_finalize(timing, got, async_op=async_op)))
            out["rs"].append([before, counter.take()[1]])  # [backwards, finalize]
            if not got:  # refused: torch cannot reduce without another backward
                out["step_refused"] = raised(opt.step)
                timing.reset_iter_state()
                opt.zero_grad()
                return out
            if manual:
                handle: ReductionHandle = got[0]
                # torch's reduction is still open: everything that reads it waits.
                out["pending"] = {
                    "done": handle.done,
                    "is_completed": handle.is_completed(),
                    "forward": raised(lambda first=micro[0]: loss_fn(m, first)),
                    "step": raised(opt.step),
                    "finalize_again": raised(timing.finalize_backward),
                }
                handle.wait()
                out["done_after_wait"] = handle.done
                out["rs_at_wait"] = counter.take()[1]
            elif async_op:
                got[0].wait()
                out["auto_async_done"] = got[0].done
            opt.step()
            opt.zero_grad()
    out["parity"] = max_abs_diff(full_params(m), ref)
    return out


def _fsdp2_nothing_pending(rank: int, world: int) -> dict[str, Any]:
    """After a finished step, finalize has nothing to do, in either mode: no collective,
    no error, None or a completed handle (as cadence's wrappers)."""
    m = _fsdp2_model()
    timing = cadence.gradient_timing(m)
    batch = make_batches("blocks", 1, 8)[0].chunk(world)[rank]
    out: dict[str, Any] = {}
    with _Counter() as counter:
        for mode, manual in (("manual", True), ("auto", False)):
            timing.set_manual_backward_finalization(manual)
            loss_fn(m, batch).backward()
            timing.finalize_backward()  # the step's own finalize (a no-op in auto mode)
            counter.take()
            got: list[Any] = []
            finalize = raised(lambda got=got: _finalize_both(timing, got))
            out[mode] = {
                "finalize": finalize,
                "blocking": got[0] if got else "not run",
                "async_done": got[1].done if len(got) > 1 else "not run",
                "rs": counter.take()[1],
            }
        # Manual mode, a no-sync backward, finalize with sync still off: nothing to
        # reduce (the gradients keep accumulating), and the backward is over, so
        # the mode may change again.
        timing.set_manual_backward_finalization(True)
        timing.set_requires_gradient_sync(False)
        loss_fn(m, batch).backward()
        counter.take()
        out["sync_off"] = {
            "finalize": raised(timing.finalize_backward),
            "rs": counter.take()[1],
            "mode_change": raised(lambda: timing.set_manual_backward_finalization(False)),
        }
    timing.reset_iter_state()
    return out


def _fsdp2_inside_backward(rank: int, world: int) -> dict[str, Any]:
    """Finalize from a hook upstream of the module, after its reduce-scatters launched."""
    batch = make_batches("blocks", 1, 8)[0].chunk(world)[rank]
    out: dict[str, Any] = {}
    for mode, manual in (("manual", True), ("auto", False)):
        m = _fsdp2_model()
        timing = cadence.gradient_timing(m)
        timing.set_manual_backward_finalization(manual)
        seen: list[str | None] = []
        x = batch.clone().requires_grad_()
        h = torch.tanh(x)  # its backward runs after every unit's
        h.register_hook(lambda _g, t=timing, s=seen: s.append(raised(t.finalize_backward)))
        m(h).float().pow(2).mean().backward()
        out[mode] = {
            "in_hook": seen[0] if seen else "hook did not run",
            "after_backward": raised(timing.finalize_backward),
        }
    return out


def _fsdp2(rank: int, world: int) -> dict[str, Any]:
    return {
        "flags": _fsdp2_flags_after_forward(rank, world),
        "deferred": _fsdp2_deferred(rank, world),
        "nothing_pending": _fsdp2_nothing_pending(rank, world),
        "inside_backward": _fsdp2_inside_backward(rank, world),
    }


# -- DDP -----------------------------------------------------------------------


def _ddp_base() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _counted_ddp(base: nn.Module, calls: list[int], **kwargs: Any) -> DDP:
    """A torch DDP whose comm hook counts its all-reduces (one bucket here)."""

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # torch checks annotations
        calls.append(1)
        return default_hooks.allreduce_hook(None, bucket)

    ddp = DDP(copy.deepcopy(base), **kwargs)
    ddp.register_comm_hook(None, hook)
    return ddp


def _timed_ddp(
    base: nn.Module, calls: list[int], *, manual: bool
) -> tuple[DDP, Any, torch.optim.Optimizer]:
    """A counted DDP, its timing adapter in the given finalization mode, and an SGD
    optimizer registered with the adapter (so a step on unreduced gradients is refused)."""
    ddp = _counted_ddp(base, calls)
    timing = cadence.gradient_timing(ddp)
    timing.set_manual_backward_finalization(manual)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    timing.register_optimizer(opt)
    return ddp, timing, opt


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _ddp(rank: int, world: int) -> dict[str, Any]:
    base = _ddp_base()
    calls: list[int] = []
    ddp = _counted_ddp(base, calls)
    ours = cadence.DataParallel(copy.deepcopy(base))
    timings = [cadence.gradient_timing(ddp), cadence.gradient_timing(ours)]
    out: dict[str, Any] = {
        "ours_is_itself": timings[1] is ours,
        "native": getattr(timings[0], "native_finalization", None),
    }
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8 * world, 8, generator=g), torch.randn(8 * world, 1, generator=g)
    micro = list(zip(x.chunk(world)[rank].chunk(2), y.chunk(world)[rank].chunk(2)))
    # Automatic mode: torch finalizes at the end of the syncing backward.
    finalized: list[str] = []
    for model, timing in zip((ddp, ours), timings):
        for i, (xb, yb) in enumerate(micro):
            timing.set_requires_gradient_sync(i == 1)  # before forward: DDP decides there
            (F.mse_loss(model(xb), yb) / 2).backward()
        before = len(calls)
        got: list[Any] = []
        finalized.append(raised(_finalize(timing, got)))
        finalized.append(raised(_finalize(timing, got, async_op=True)))
        out.setdefault("auto_finalize_all_reduces", len(calls) - before)
        out.setdefault("auto_finalize_returned", [got[0], got[1].done] if len(got) == 2 else got)
    out["auto_finalize"] = finalized
    out["ddp_all_reduces"] = len(calls)
    reduced = _grads(ours)  # the reduced gradients of this data (cadence.DataParallel)
    out["parity"] = max_abs_diff(_grads(ddp), reduced)
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
    # An automatic-mode finalize from inside a syncing backward: torch writes .grad
    # only when that backward ends, so the adapter refuses instead of returning.
    out["auto_inside_backward"] = _ddp_inside_backward(ddp, timings[0], xr, yr)
    # static_graph: DDP's first iterations need the decision at forward; a flip refused.
    static = DDP(copy.deepcopy(base), static_graph=True)
    st = cadence.gradient_timing(static)
    loss = F.mse_loss(static(xr), yr)
    out["flip_after_forward"] = raised(lambda: st.set_requires_gradient_sync(False))
    loss.backward()
    # Zero-bubble split backwards: refused by the adapter, and up front by the pipeline.
    out["split"] = raised(lambda: timings[0].split_backward("input"))
    out["split_refusal"] = [StageGradSync(m).split_refusal() for m in (ddp, ours)]
    out["manual"] = _ddp_manual(base, micro, reduced)
    out["deferred"] = _ddp_deferred(base, micro)
    return out


def _ddp_inside_backward(
    ddp: nn.Module, timing: Any, x: torch.Tensor, y: torch.Tensor
) -> str | None:
    seen: list[str | None] = []
    h = torch.tanh(x.clone().requires_grad_())  # its backward runs after the bucket is ready
    h.register_hook(lambda _g: seen.append(raised(timing.finalize_backward)))
    F.mse_loss(ddp(h), y).backward()
    if not timing.require_manual_backward_finalization:
        timing.finalize_backward()  # nothing pending: torch finalized at the end
    return seen[0] if seen else "hook did not run"


def _ddp_manual(
    base: nn.Module,
    micro: list[tuple[torch.Tensor, torch.Tensor]],
    reduced: dict[str, torch.Tensor | None],
) -> dict[str, Any]:
    """Manual mode: the syncing backward launches the all-reduce, finalize writes .grad."""
    calls: list[int] = []
    ddp, timing, opt = _timed_ddp(base, calls, manual=True)
    out: dict[str, Any] = {}
    for i, (xb, yb) in enumerate(micro):
        timing.set_requires_gradient_sync(i == 1)
        loss = F.mse_loss(ddp(xb), yb) / 2
        out[f"should_finalize_{i}"] = timing.should_finalize_after_backward
        loss.backward()
    out["backward_all_reduces"] = len(calls)
    out["grad_vs_reduced_after_backward"] = max_abs_diff(_grads(ddp), reduced)
    got: list[Any] = []
    out["finalize"] = raised(_finalize(timing, got, async_op=True))
    if not got:
        return out
    handle: ReductionHandle = got[0]
    out["pending"] = {
        "done": handle.done,
        "is_completed": handle.is_completed(),
        "forward": raised(lambda: ddp(micro[0][0])),
        "step": raised(opt.step),
        "finalize_again": raised(timing.finalize_backward),
    }
    handle.wait()
    out["done_after_wait"] = handle.done
    out["all_reduces_at_wait"] = len(calls) - out["backward_all_reduces"]
    out["parity_after_wait"] = max_abs_diff(_grads(ddp), reduced)
    out["second_finalize"] = raised(timing.finalize_backward)  # nothing pending now
    # Optimizer-in-backward: finalize and step from a hook upstream of the module,
    # once the bucket is ready (the previous iteration has rebuilt DDP's buckets).
    opt.zero_grad()
    calls.clear()
    xr, yr = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
    out["inside_backward"] = _ddp_inside_backward(ddp, timing, xr, yr)
    out["inside_backward_all_reduces"] = len(calls)
    out["after_inside_backward"] = raised(timing.finalize_backward)  # nothing left
    # Too early: from a hook inside the module, before the first layer's gradients
    # (so the bucket) are ready. Refused; the caller's finalize after backward works.
    seen: list[str | None] = []

    def watch_first_layer(_m: nn.Module, _i: Any, o: torch.Tensor) -> None:
        o.register_hook(lambda _g: seen.append(raised(timing.finalize_backward)))

    first = ddp.module[0].register_forward_hook(watch_first_layer)
    F.mse_loss(ddp(xr), yr).backward()
    first.remove()
    out["too_early"] = seen[0] if seen else "hook did not run"
    out["after_too_early"] = raised(timing.finalize_backward)
    return out


def _ddp_deferred(
    base: nn.Module, micro: list[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, Any]:
    """Every backward with sync off, then sync on and finalize: DDP reduces only from a
    backward's hooks, so this is refused with the fix, in either mode."""
    out: dict[str, Any] = {}
    for mode, manual in (("manual", True), ("auto", False)):
        calls: list[int] = []
        ddp, timing, opt = _timed_ddp(base, calls, manual=manual)
        timing.set_requires_gradient_sync(False)
        for xb, yb in micro:
            (F.mse_loss(ddp(xb), yb) / 2).backward()
        timing.set_requires_gradient_sync(True)
        out[mode] = {
            "finalize": raised(timing.finalize_backward),
            "step": raised(opt.step),
            "all_reduces": len(calls),
        }
        timing.reset_iter_state()
    return out


def torch_timing_body() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    return {"fsdp2": _fsdp2(rank, world), "ddp": _ddp(rank, world)}
