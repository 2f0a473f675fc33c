"""World-2 rank body for the semantics tests: one launch, one entry per check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import cadence
from cadence.fsdp import FullyShardError, MixedPrecisionPolicy, fully_shard
from cadence.testing import max_abs_diff, run_subtests
from tests.fsdp.common import (
    Block,
    apply_cadence,
    full_params,
    loss_fn,
    make_batches,
    make_blocks,
    reference_steps,
    train_steps,
)

__all__ = ["semantics_body"]


def _error(fn: Callable[[], object]) -> str:
    try:
        fn()
    except (FullyShardError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _model(log: cadence.EventLog | None = None, **kw: Any) -> Any:
    m = make_blocks()
    return apply_cadence(m, m.units(), event_log=log, **kw)


def _batch(rank: int, world: int) -> torch.Tensor:
    return make_batches("blocks", 1, 8)[0].chunk(world)[rank]


def _checks_errors(rank: int, world: int, out: dict[str, Any]) -> None:
    x = _batch(rank, world)
    # Tying across units.
    m = make_blocks()
    m.head.weight = nn.Parameter(torch.randn(1, 16))
    m.blocks[0].lin.weight = m.blocks[1].lin.weight
    fully_shard(m.blocks[1])
    out["err_tied_across_units"] = _error(lambda: fully_shard(m))
    # fully_shard twice.
    b = Block(4)
    fully_shard(b)
    out["err_twice"] = _error(lambda: fully_shard(b))
    # Top-down application.
    m = make_blocks()
    fully_shard(m)
    out["err_top_down"] = _error(lambda: fully_shard(m.blocks[0]))
    # Mixed dtypes in one unit.
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    out["err_mixed_dtypes"] = _error(lambda: fully_shard(mixed))
    # Handle misuse.
    m = _model()
    m.set_manual_backward_finalization(True)
    m(x).pow(2).mean().backward()
    handle = m.finalize_backward(async_op=True)
    out["err_second_finalize"] = _error(lambda: m.finalize_backward())
    out["err_forward_pending"] = _error(lambda: m(x))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m.register_optimizer(opt)
    out["err_step_pending_handle"] = _error(opt.step)
    out["err_unshard_pending"] = _error(lambda: m.unshard())
    handle.wait()
    out["after_wait_forward_ok"] = _error(lambda: m(x).sum()) == "no error"
    # Finalize / manual toggle inside backward (raised in a hook; caught there).
    seen: dict[str, str] = {}
    y = m(x)

    def hook(g: torch.Tensor) -> torch.Tensor:
        seen["finalize"] = _error(lambda: m.finalize_backward())
        seen["toggle"] = _error(lambda: m.set_manual_backward_finalization(False))
        return g

    y.register_hook(hook)
    y.pow(2).mean().backward()
    m.finalize_backward()
    out["err_finalize_in_backward"] = seen["finalize"]
    out["err_toggle_in_backward"] = seen["toggle"]
    out["err_prefetch_not_unit"] = _error(
        lambda: m.set_modules_to_forward_prefetch([nn.Linear(1, 1)])
    )
    # optimizer.step() after a manual backward, before finalize_backward().
    m2 = _model()
    m2.set_manual_backward_finalization(True)
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    m2.register_optimizer(opt2)
    m2(x).pow(2).mean().backward()
    out["err_step_unfinalized"] = _error(opt2.step)
    m2.finalize_backward()
    opt2.step()
    out["step_after_finalize_ok"] = True


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def _checks_reset(rank: int, world: int, out: dict[str, Any]) -> None:
    x = _batch(rank, world)
    m = _model()
    # Block 0's backward raises after the root and blocks 2, 1 have started theirs.
    boom = m.blocks[0].lin.register_forward_hook(lambda mod, a, o: _Boom.apply(o))
    try:
        m(x).sum().backward()
    except RuntimeError:
        pass
    boom.remove()
    out["err_forward_after_failed_backward"] = _error(lambda: m(x))
    m.reset_iter_state()
    # After the reset a full step matches the reference.
    batches = make_batches("blocks", 1, 8)
    ref = reference_steps(make_blocks(), batches)
    train_steps(m, batches, rank, world)
    out["reset_then_step_parity"] = max_abs_diff(full_params(m), ref)


def _checks_prefetch(rank: int, world: int, out: dict[str, Any]) -> None:
    x = _batch(rank, world)
    log = cadence.EventLog()
    m = _model(log, unit_raf=True)
    seen: dict[str, str] = {}
    m.blocks[0].lin.register_forward_hook(
        lambda *a: seen.__setitem__("fwd_b1", m.blocks[1]._cadence_unit.state.value)
    )
    m.blocks[1].lin.register_full_backward_hook(
        lambda *a: seen.__setitem__("bwd_b0", m.blocks[0]._cadence_unit.state.value)
    )
    m(x).sum().backward()  # iteration 1 records the forward order
    seen.clear()
    m(x).sum().backward()
    out["implicit_forward_prefetch_state"] = seen["fwd_b1"]
    out["implicit_backward_prefetch_state"] = seen["bwd_b0"]
    # Explicit list: block 0 prefetches block 2 (not the implicit block 1).
    m.blocks[0].set_modules_to_forward_prefetch([m.blocks[2]])
    m.blocks[0].lin.register_forward_hook(
        lambda *a: seen.__setitem__("fwd_b2", m.blocks[2]._cadence_unit.state.value)
    )
    seen.clear()
    log.clear()
    m(x).sum().backward()
    out["explicit_prefetch_state"] = seen["fwd_b2"]
    out["explicit_prefetch_counts"] = (log.count("all_gather"), log.count("reduce_scatter"))
    # Public unshard(async_op=True): a handle; wait() registers plain unsharded params.
    block = m.blocks[0]
    handle = block.unshard(async_op=True)
    out["unshard_handle"] = type(handle).__name__
    out["unshard_state_before_wait"] = block._cadence_unit.state.value
    handle.wait()
    handle.wait()
    out["unshard_param_after_wait"] = type(block.lin.weight).__name__
    block.reshard()
    out["unshard_param_after_reshard"] = type(block.lin.weight).__name__
    # Forward-only: raf=False root + raf=True blocks gather once per unit before forward.
    log.clear()
    with torch.no_grad():
        m(x)
    out["forward_only_all_gathers"] = log.count("all_gather")


def _bounded(rank: int, world: int, bound: int) -> tuple[int, int]:
    """(peak reductions in flight, reduce-scatters) of one backward with ``bound``."""
    log = cadence.EventLog()
    m = _model(log)
    m.set_max_inflight_reductions(bound)
    m(_batch(rank, world)).pow(2).mean().backward()
    return m.memory_stats()["peak_inflight_reductions"], log.count("reduce_scatter")


def _written(p: Any) -> bool:
    """``p.grad`` holds a gradient (not None, not the pending-reduction placeholder)."""
    from cadence._grad_timing.pending_grad import PendingGrad

    g = p.grad
    return g is not None and not isinstance(getattr(g, "_local_tensor", g), PendingGrad)


def _checks_reduce(rank: int, world: int, out: dict[str, Any]) -> None:
    x = _batch(rank, world)
    bounded = run_subtests({"bound": [1, 2]}, _bounded, rank, world)
    for bound in (1, 2):
        peak, rs = bounded[f"bound={bound}"]
        out[f"peak_inflight_bound{bound}"] = peak
        out[f"rs_count_bound{bound}"] = rs
    # Asynchronous: in manual mode, after backward the reductions are issued, not waited.
    log = cadence.EventLog()
    m = _model(log)
    m.set_manual_backward_finalization(True)
    out["should_finalize"] = m.should_finalize_after_backward
    m(x).pow(2).mean().backward()
    rs = log.collectives("reduce_scatter")
    out["rs_issued_in_backward"] = len(rs)
    out["rs_unwaited_after_backward"] = sum(1 for e in rs if e.wait_end_t is None)
    # Until written, .grad is a placeholder that raises on use (see cadence/_grad_timing/pending_grad.py).
    out["grads_before_finalize"] = sum(_written(p) for p in m.parameters())
    handle = m.finalize_backward(async_op=True)
    out["handle_type"] = type(handle).__name__
    out["grads_before_wait"] = sum(_written(p) for p in m.parameters())
    out["inflight_before_wait"] = m.memory_stats()["inflight_reductions"] > 0 or bool(
        m._runtime.retired
    )
    handle.wait()
    grads = {n: p.grad.to_local().clone() for n, p in m.named_parameters()}
    handle.wait()  # idempotent
    out["wait_idempotent"] = max_abs_diff(
        {n: p.grad.to_local() for n, p in m.named_parameters()}, grads
    )
    out["rs_after_waits"] = log.count("reduce_scatter")
    out["grads_after_wait"] = sum(isinstance(p.grad, DTensor) for p in m.parameters())
    out["buffers_after_wait"] = m.memory_stats()["inflight_reduce_bytes"] + len(m._runtime.retired)


def _checks_overlap(rank: int, world: int, out: dict[str, Any]) -> None:
    x = _batch(rank, world)
    log = cadence.EventLog()
    m = _model(log)
    m.set_manual_backward_finalization(True)
    m.set_max_inflight_reductions(4)  # every unit's reduction stays in flight
    m.set_requires_gradient_sync(False)
    m(x).pow(2).mean().backward()
    m.set_requires_gradient_sync(True)
    handle = m.finalize_backward(async_op=True)
    start = log.mark("user_work_start")
    a = torch.randn(128, 128)
    for _ in range(20):
        a = torch.tanh(a @ a)
    end = log.mark("user_work_end")
    handle.wait()
    rs = log.collectives("reduce_scatter")
    out["overlap_rs"] = len(rs)
    out["overlap_issued_before_work"] = all(e.issue_t < start.issue_t for e in rs)
    out["overlap_waited_after_work"] = all(
        e.wait_start_t is not None and e.wait_start_t > end.issue_t for e in rs
    )


def _micro_run(
    rank: int, world: int, before: Callable[[Any, int, bool], None], finalize: str | None
) -> tuple[float, list[tuple[int, int]], int]:
    """2 microbatches x 2 steps; returns (parity, per-microbatch counts, finalize RS count)."""
    batches = make_batches("blocks", 2, 8)
    ref = reference_steps(make_blocks(), batches)
    log = cadence.EventLog()
    m = _model(log, unit_raf=True)
    if finalize is not None:
        m.set_manual_backward_finalization(True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    counts: list[tuple[int, int]] = []
    fin_rs = 0
    for batch in batches:
        for i, mb in enumerate(batch.chunk(world)[rank].chunk(2)):
            before(m, i, i == 1)
            log.clear()
            (loss_fn(m, mb) / 2).backward()
            counts.append((log.count("all_gather"), log.count("reduce_scatter")))
        if finalize is not None:
            m.set_requires_gradient_sync(True)
            log.clear()
            handle = m.finalize_backward(async_op=finalize == "async")
            if handle is not None:
                handle.wait()
            fin_rs = log.count("reduce_scatter")
        opt.step()
        opt.zero_grad()
    # full_state_dict reads the shards: a kept unsharded copy is stale after the step.
    return max_abs_diff(m.full_state_dict(), ref), counts, fin_rs


def _checks_modes(rank: int, world: int, out: dict[str, Any]) -> None:
    nothing = lambda m, i, last: None  # noqa: E731
    nosync = lambda m, i, last: m.set_requires_gradient_sync(last)  # noqa: E731

    def zero1(m: Any, i: int, last: bool) -> None:
        m.set_requires_gradient_sync(last)
        m.set_reshard_after_backward(last)

    def never(m: Any, i: int, last: bool) -> None:
        m.set_requires_gradient_sync(False)

    def keep(m: Any, i: int, last: bool) -> None:
        m.set_requires_gradient_sync(last)
        m.set_reshard_after_backward(False)

    modes = {
        "every": (nothing, None),
        "nosync": (nosync, None),
        "zero1": (zero1, None),
        "deferred_sync": (never, "sync"),
        "deferred_async": (never, "async"),
        "manual_sync_last": (nosync, "async"),
        "keep_unsharded": (keep, "sync"),
    }
    runs = run_subtests({"mode": list(modes)}, lambda mode: _micro_run(rank, world, *modes[mode]))
    for name in modes:
        parity, counts, fin_rs = runs[f"mode={name!r}"]
        out[f"mode_{name}_parity"] = parity
        out[f"mode_{name}_counts"] = counts
        out[f"mode_{name}_finalize_rs"] = fin_rs
    # Finalize follows the flags: with sync still off, it reduces nothing and keeps grads.
    m = _model()
    m.set_manual_backward_finalization(True)
    m.set_requires_gradient_sync(False)
    m(_batch(rank, world)).pow(2).mean().backward()
    acc = m.memory_stats()["accumulated_grad_bytes"]
    out["finalize_nosync_returns"] = repr(m.finalize_backward())
    out["finalize_nosync_keeps_accum"] = m.memory_stats()["accumulated_grad_bytes"] == acc > 0
    out["finalize_nosync_flag_unchanged"] = not m._cadence_unit.requires_gradient_sync
    # reshard_after_backward=False is preserved through finalize.
    m.set_reshard_after_backward(False)
    m.set_requires_gradient_sync(True)
    m(_batch(rank, world)).pow(2).mean().backward()
    m.finalize_backward()
    out["preserved_unsharded"] = [
        u.state.value for u in (m._cadence_unit, m.blocks[0]._cadence_unit)
    ]


def _checks_retry(rank: int, world: int, out: dict[str, Any]) -> None:
    batches = make_batches("blocks", 1, 8)
    ref = reference_steps(make_blocks(), batches)
    log = cadence.EventLog()
    m = _model(log)
    m.set_manual_backward_finalization(True)
    calls = {"n": 0}

    def fault(unit: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected cleanup failure")

    m._runtime.cleanup_fault = fault
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(batches[0].chunk(world)[rank]).pow(2).mean().backward()
    handle = m.finalize_backward(async_op=True)
    try:
        handle.wait()
        out["retry_first_raised"] = False
    except RuntimeError:
        out["retry_first_raised"] = True
    rs_before = log.count("reduce_scatter")
    out["retry_done_after_failure"] = handle.done
    handle.wait()
    out["retry_done"] = handle.done
    out["retry_rs_growth"] = log.count("reduce_scatter") - rs_before
    opt.step()
    out["retry_parity"] = max_abs_diff(full_params(m), ref)


def _checks_mixed_precision(rank: int, world: int, out: dict[str, Any]) -> None:
    batches = make_batches("blocks", 1, 8)
    ref = reference_steps(make_blocks(), batches)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    m = _model(mp_policy=policy)
    seen: dict[str, str] = {}
    m.blocks[0].lin.register_forward_hook(
        lambda mod, a, o: seen.update(param=str(mod.weight.dtype), out=str(o.dtype))
    )
    x = batches[0].chunk(world)[rank]
    m.set_requires_gradient_sync(False)
    y = m(x)
    out["mp_compute_dtype"] = seen["param"]
    out["mp_output_dtype"] = str(y.dtype)
    y.float().pow(2).mean().backward()
    stats = m.memory_stats()
    padded = sum(world * u.shard_numel for u in m._runtime.units)
    out["mp_accum_bytes"] = stats["accumulated_grad_bytes"]
    out["mp_accum_expected_fp32"] = padded * 4
    m.set_requires_gradient_sync(True)
    m.finalize_backward()
    out["mp_grad_dtype"] = str(next(m.parameters()).grad.dtype)
    out["mp_param_dtype"] = str(next(m.parameters()).dtype)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    opt.step()
    out["mp_parity"] = max_abs_diff(full_params(m), ref)
    # Accumulating in bf16 instead halves the retained buffer.
    m2 = _model(
        mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32, None, True, torch.bfloat16)
    )
    m2.set_requires_gradient_sync(False)
    m2(x).float().pow(2).mean().backward()
    out["mp_accum_bytes_bf16"] = m2.memory_stats()["accumulated_grad_bytes"]
    out["mp_output_dtype_policy"] = str(
        _model(mp_policy=MixedPrecisionPolicy(torch.bfloat16, None, torch.float32))(x).dtype
    )


def _checks_memory(rank: int, world: int, out: dict[str, Any]) -> None:
    m = make_blocks()
    m = apply_cadence(m, m.units(), unit_raf=True)
    unit_bytes = [u.unsharded_flat.numel() * 4 for u in m._runtime.units]
    m(_batch(rank, world)).pow(2).mean().backward()
    stats = m.memory_stats()
    out["mem_sharded"] = stats["sharded_param_bytes"]
    out["mem_sharded_expected"] = sum(u.shard_numel * 4 for u in m._runtime.units)
    out["mem_peak_unsharded"] = stats["peak_unsharded_param_bytes"]
    # At most: the root, the running block and one prefetched block.
    blocks = sorted(unit_bytes[:-1])
    out["mem_peak_bound"] = unit_bytes[-1] + sum(blocks[-2:])
    out["mem_after_step_unsharded"] = stats["unsharded_param_bytes"]
    out["mem_root_bytes"] = unit_bytes[-1]


def _checks_state_dict(rank: int, world: int, out: dict[str, Any]) -> None:
    base = make_blocks()
    ref_sd = {k: v.clone() for k, v in base.state_dict().items()}
    m = make_blocks()
    m = apply_cadence(m, m.units())
    sd = m.state_dict()
    out["sd_keys_same"] = sorted(sd) == sorted(ref_sd)
    out["sd_all_dtensor"] = all(isinstance(v, DTensor) for v in sd.values())
    out["full_sd_equal"] = max_abs_diff(m.full_state_dict(), ref_sd)
    # Round trip through the full form into a model with different weights.
    other = apply_cadence(Blocks_fresh(), [])
    other.load_full_state_dict(ref_sd)
    out["load_full_equal"] = max_abs_diff(other.full_state_dict(), ref_sd)
    # And the sharded form.
    fresh = Blocks_fresh()
    fresh = apply_cadence(fresh, fresh.units())
    fresh.load_state_dict(m.state_dict())
    out["load_sharded_equal"] = max_abs_diff(fresh.full_state_dict(), ref_sd)
    # Tied parameters in one unit stay one object.
    from tests.fsdp.common import TinyTransformer

    t = TinyTransformer()
    apply_cadence(t, t.units())
    out["tied_same_object"] = t.head.weight is t.emb.weight
    t(torch.randint(0, 11, (2, 5))).sum().backward()
    out["tied_same_object_after_step"] = t.head.weight is t.emb.weight


def Blocks_fresh() -> Any:
    torch.manual_seed(9)
    from tests.fsdp.common import Blocks

    return Blocks()


def semantics_body() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for check in (
        _checks_errors,
        _checks_reset,
        _checks_prefetch,
        _checks_reduce,
        _checks_overlap,
        _checks_modes,
        _checks_retry,
        _checks_mixed_precision,
        _checks_memory,
        _checks_state_dict,
    ):
        check(rank, world, out)
    return out
