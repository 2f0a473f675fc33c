"""Rank bodies for collective counts, accumulation, unused parameters, reentrant
checkpointing, buffers, wire dtypes and comm hooks; `timing_suite` runs them all in one launch."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cadence
from cadence.testing import max_abs_diff, named_grads, run_subtests
from tests.dp.common import (
    WIDTH,
    RankDependent,
    TwoHeads,
    expect_error,
    global_batch,
    local,
    make_mlp,
    strip,
)


def counts() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    log = cadence.EventLog()
    dp = cadence.DataParallel(
        make_mlp(), bucket_cap_mb=0.001, first_bucket_cap_mb=None, event_log=log
    )
    res: dict[str, Any] = {"buckets": dp.num_buckets}
    x, y = global_batch(0, world)
    xl, yl = local(x, rank, world), local(y, rank, world)

    def step() -> None:
        F.mse_loss(dp(xl), yl).backward()

    log.clear()
    step()
    res["auto"] = log.count("all_reduce")
    res["auto_sig"] = log.signature()
    dp.require_manual_backward_finalization = True
    log.clear()
    step()
    res["manual_before_finalize"] = log.count("all_reduce")
    dp.finalize_backward()
    res["manual"] = log.count("all_reduce")
    res["manual_sig"] = log.signature()
    log.clear()
    res["finalize_nothing"] = dp.finalize_backward()
    res["finalize_nothing_count"] = log.count()
    # K=3 accumulation with no_sync, then a synced backward.
    dp.require_manual_backward_finalization = False
    log.clear()
    with dp.no_sync():
        step()
        step()
    res["no_sync"] = log.count("all_reduce")
    step()
    res["accum_total"] = log.count("all_reduce")
    # Deferred: accumulate with the setter, then finalize with sync on.
    log.clear()
    dp.set_requires_gradient_sync(False)
    step()
    step()
    res["deferred_before"] = log.count("all_reduce")
    dp.set_requires_gradient_sync(True)
    dp.finalize_backward()
    res["deferred"] = log.count("all_reduce")
    # Cross-rank order check happens in the parent (signatures from every rank).
    unused = cadence.DataParallel(
        TwoHeads(), find_unused_parameters=True, event_log=cadence.EventLog()
    )
    unused.event_log.clear()
    F.mse_loss(unused(xl), yl).backward()
    res["unused_buckets"] = unused.num_buckets
    res["unused_count"] = unused.event_log.count("all_reduce")
    res["unused_grad_none"] = unused.module.b.weight.grad is None
    return res


def unused_on_one_rank() -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, world)
    xl, yl = local(x, rank, world), local(y, rank, world)
    m = RankDependent()
    dp = cadence.DataParallel(copy.deepcopy(m), find_unused_parameters=True)
    ddp = DDP(copy.deepcopy(m), find_unused_parameters=True)
    F.mse_loss(dp(xl), yl).backward()
    F.mse_loss(ddp(xl), yl).backward()
    sig = dp.event_log.signature()
    return {
        "diff": max_abs_diff(strip(named_grads(dp)), strip(named_grads(ddp))),
        "b_grad_set": float(dp.module.b.weight.grad is not None),
        "sig": sig,
    }


# ---------------------------------------------------------------------------
# Accumulation
# ---------------------------------------------------------------------------


def accumulation(kind: str) -> float:
    """K=4 microbatches accumulated, one reduction; compare to the reference on all of them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_mlp()
    ref = copy.deepcopy(model)
    dp = cadence.DataParallel(copy.deepcopy(model), bucket_cap_mb=0.002)
    k = 4
    batches = [global_batch(i, world) for i in range(k)]

    def micro(i: int) -> torch.Tensor:
        x, y = batches[i]
        return F.mse_loss(dp(local(x, rank, world)), local(y, rank, world)) / k

    if kind == "no_sync":
        with dp.no_sync():
            for i in range(k - 1):
                micro(i).backward()
        micro(k - 1).backward()
    elif kind == "setter":
        dp.set_requires_gradient_sync(False)
        for i in range(k - 1):
            micro(i).backward()
        dp.set_requires_gradient_sync(True)
        micro(k - 1).backward()
    elif kind == "deferred":
        dp.set_requires_gradient_sync(False)
        for i in range(k):
            micro(i).backward()
        dp.set_requires_gradient_sync(True)
        assert dp.state is cadence.WindowState.ACCUMULATING
        dp.finalize_backward()
    elif kind == "interleaved":
        # 1F1B-like: all forwards outstanding, backwards FIFO, setter flipped before the last.
        losses = [micro(i) for i in range(k)]
        dp.set_requires_gradient_sync(False)
        for i in range(k - 1):
            losses[i].backward()
        dp.set_requires_gradient_sync(True)
        losses[k - 1].backward()
    elif kind == "fwd_outside_bwd_inside":
        loss = micro(0)
        log = dp.event_log
        log.clear()
        with dp.no_sync():
            loss.backward()
        assert log.count("all_reduce") == 0, "a backward inside no_sync reduced"
        for i in range(1, k):
            micro(i).backward()
    else:
        raise ValueError(kind)
    for i in range(k):
        x, y = batches[i]
        (F.mse_loss(ref(x), y) / k).backward()
    return max_abs_diff(strip(named_grads(dp)), named_grads(ref))


class _Twice(nn.Module):
    """One layer used twice under reentrant checkpointing: its hook fires twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        h = checkpoint(self.shared, h, use_reentrant=True)
        h = checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        return self.out(h)


def reentrant() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    res: dict[str, Any] = {}
    model = _Twice()
    ref = copy.deepcopy(model)
    static = cadence.DataParallel(copy.deepcopy(model), static_graph=True, bucket_cap_mb=0.001)
    for step in range(2):
        x, y = global_batch(step, world)
        for p in static.parameters():
            p.grad = None
        ref.zero_grad()
        F.mse_loss(static(local(x, rank, world).requires_grad_()), local(y, rank, world)).backward()
        F.mse_loss(ref(x), y).backward()
        res[f"static_step{step}"] = max_abs_diff(strip(named_grads(static)), named_grads(ref))
    plain = cadence.DataParallel(copy.deepcopy(model), bucket_cap_mb=0.001)
    x, y = global_batch(0, world)
    res["twice_error"] = expect_error(
        lambda: F.mse_loss(
            plain(local(x, rank, world).requires_grad_()), local(y, rank, world)
        ).backward(),
        "'shared.",
        "static_graph=True",
    )
    # A reentrant-checkpointed *last* layer runs its backward in a nested graph task: the
    # window must still finalize at the end of the outer backward, not of the nested one.
    from torch.utils.checkpoint import checkpoint

    class CkptHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.body = make_mlp(depth=2)
            self.head = nn.Linear(1, 1)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.head, self.body(t), use_reentrant=True)

    m = CkptHead()
    ref2 = copy.deepcopy(m)
    dp = cadence.DataParallel(copy.deepcopy(m), bucket_cap_mb=0.001)
    F.mse_loss(dp(local(x, rank, world)), local(y, rank, world)).backward()
    F.mse_loss(ref2(x), y).backward()
    res["ckpt_head"] = max_abs_diff(strip(named_grads(dp)), named_grads(ref2))
    res["ckpt_head_state"] = dp.state.value
    return res


def buffers_and_init() -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # every rank initialises differently
    m = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, 1))
    dp = cadence.DataParallel(m)
    params = torch.cat([p.detach().reshape(-1) for p in dp.parameters()])
    gathered = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    init_diff = max(float((g - gathered[0]).abs().max()) for g in gathered)
    # Make the running stats diverge, then a forward broadcasts rank 0's.
    with torch.no_grad():
        dp.module[1].running_mean.fill_(float(rank + 1))
    x, _ = global_batch(0, world)
    dp.module.eval()  # so this forward does not update the stats after the broadcast
    dp(local(x, rank, world)).sum().backward()
    rm = dp.module[1].running_mean.clone()
    got = [torch.empty_like(rm) for _ in range(world)]
    dist.all_gather(got, rm)
    return {
        "init_diff": init_diff,
        "buffer_diff": max(float((g - got[0]).abs().max()) for g in got),
    }


def bf16_wire() -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_mlp()
    ref = copy.deepcopy(model)
    res = {}
    x, y = global_batch(0, world)
    F.mse_loss(ref(x), y).backward()
    gref = named_grads(ref)
    for name, kw, hook in (
        ("reduce_dtype_bf16", {"reduce_dtype": torch.bfloat16}, None),
        ("bf16_hook", {}, cadence.data_parallel.comm_hooks.bf16_compress_hook),
        ("fp16_hook", {}, cadence.data_parallel.comm_hooks.fp16_compress_hook),
        ("allreduce_hook", {}, cadence.data_parallel.comm_hooks.allreduce_hook),
    ):
        dp = cadence.DataParallel(copy.deepcopy(model), **kw)
        if hook is not None:
            dp.register_comm_hook(None, hook)
        F.mse_loss(dp(local(x, rank, world)), local(y, rank, world)).backward()
        g = strip(named_grads(dp))
        res[name] = max_abs_diff(g, gref)
        res[name + "_dtype_ok"] = float(all(v.dtype == torch.float32 for v in g.values()))
        res[name + "_count"] = float(dp.event_log.count("all_reduce"))
    # A torch DDP hook works unchanged (Future-returning, gets un-divided buckets).
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    dp = cadence.DataParallel(copy.deepcopy(model))
    dp.register_comm_hook(None, default_hooks.allreduce_hook)
    F.mse_loss(dp(local(x, rank, world)), local(y, rank, world)).backward()
    res["torch_hook"] = max_abs_diff(strip(named_grads(dp)), gref)
    return res


ACCUMULATION = ["no_sync", "setter", "deferred", "interleaved", "fwd_outside_bwd_inside"]


def timing_suite() -> dict[str, Any]:
    """Every body above in one launch (process start-up dominates their cost)."""
    acc = run_subtests({"kind": ACCUMULATION}, accumulation)
    return {
        "counts": counts(),
        "unused_on_one_rank": unused_on_one_rank(),
        "accumulation": {kind: acc[f"kind={kind!r}"] for kind in ACCUMULATION},
        "reentrant": reentrant(),
        "buffers": buffers_and_init(),
        "wire": bf16_wire(),
    }
