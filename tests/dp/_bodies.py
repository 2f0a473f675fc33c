"""Test bodies that run inside each rank (module level, so they ship by reference)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cadence
from cadence.testing import max_abs_diff, named_grads, named_params

WIDTH = 16
PER_RANK = 4


def make_mlp(seed: int = 0, depth: int = 4, width: int = WIDTH) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def global_batch(step: int, world: int, n: int = PER_RANK) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * n, WIDTH, generator=g)
    y = torch.randn(world * n, 1, generator=g)
    return x, y


def local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def _strip(d: dict[str, Any]) -> dict[str, Any]:
    return {k.removeprefix("module."): v for k, v in d.items()}


def parity(config: dict[str, Any]) -> dict[str, float]:
    """Train 3 AdamW steps with cadence, the single-process reference and (optionally) torch DDP.

    Returns the worst gradient / parameter differences against each oracle.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mode = config.get("mode", "auto")
    dp_kwargs = dict(config.get("dp", {}))
    model = make_mlp(config.get("seed", 0))
    ref = copy.deepcopy(model)
    dp = cadence.DataParallel(copy.deepcopy(model), **dp_kwargs)
    if mode != "auto":
        dp.require_manual_backward_finalization = True
    opt = torch.optim.AdamW(dp.parameters(), lr=1e-2)
    dp.register_optimizer(opt)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ddp = ddp_opt = None
    if config.get("ddp", True):
        ddp_kwargs = {
            k: v
            for k, v in dp_kwargs.items()
            if k in ("bucket_cap_mb", "gradient_as_bucket_view", "find_unused_parameters")
        }
        ddp = DDP(copy.deepcopy(model), **ddp_kwargs)
        ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    out = {"grad_ref": 0.0, "grad_ddp": 0.0, "param_ref": 0.0, "param_ddp": 0.0}
    for step in range(3):
        x, y = global_batch(step, world)
        xl, yl = local(x, rank, world), local(y, rank, world)

        opt.zero_grad(set_to_none=config.get("set_to_none", True))
        loss = F.mse_loss(dp(xl), yl)
        loss.backward()
        if mode == "manual":
            dp.finalize_backward()
        elif mode == "async":
            handle = dp.finalize_backward(async_op=True)
            assert handle is not None
            torch.randn(64, 64) @ torch.randn(64, 64)  # independent work while in flight
            handle.wait()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        g = _strip(named_grads(dp))
        gr = named_grads(ref)
        out["grad_ref"] = max(out["grad_ref"], max_abs_diff(g, gr))
        if ddp is not None:
            ddp_opt.zero_grad()
            F.mse_loss(ddp(xl), yl).backward()
            out["grad_ddp"] = max(out["grad_ddp"], max_abs_diff(g, _strip(named_grads(ddp))))
            ddp_opt.step()
        opt.step()
        ref_opt.step()
    p = _strip(named_params(dp))
    out["param_ref"] = max_abs_diff(p, named_params(ref))
    if ddp is not None:
        out["param_ddp"] = max_abs_diff(p, _strip(named_params(ddp)))
    out["num_buckets"] = float(dp.num_buckets)
    return out


def parity_suite(configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    return {name: parity(cfg) for name, cfg in configs.items()}


# ---------------------------------------------------------------------------
# Collective counts
# ---------------------------------------------------------------------------


def counts() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    log = cadence.EventLog()
    dp = cadence.DataParallel(
        make_mlp(), bucket_cap_mb=0.001, first_bucket_cap_mb=None, event_log=log
    )
    n = dp.num_buckets
    from cadence._timing import GradientTiming

    res: dict[str, Any] = {"buckets": n, "is_gradient_timing": isinstance(dp, GradientTiming)}
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
        _TwoHeads(), find_unused_parameters=True, event_log=cadence.EventLog()
    )
    unused.event_log.clear()
    F.mse_loss(unused(xl), yl).backward()
    res["unused_buckets"] = unused.num_buckets
    res["unused_count"] = unused.event_log.count("all_reduce")
    res["unused_grad_none"] = unused.module.b.weight.grad is None
    return res


class _TwoHeads(nn.Module):
    """``b`` is never used: a globally unused parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(WIDTH, 1)
        self.b = nn.Linear(WIDTH, 1)

        self.use_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) if self.use_b else self.a(x)


class _RankDependent(nn.Module):
    """``b`` is used on rank 0 only: DDP averages including rank 1's zero."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(WIDTH, 1)
        self.b = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 0:
            return self.a(x) + self.b(x)
        return self.a(x)


def unused_on_one_rank() -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, world)
    xl, yl = local(x, rank, world), local(y, rank, world)
    m = _RankDependent()
    dp = cadence.DataParallel(copy.deepcopy(m), find_unused_parameters=True)
    ddp = DDP(copy.deepcopy(m), find_unused_parameters=True)
    F.mse_loss(dp(xl), yl).backward()
    F.mse_loss(ddp(xl), yl).backward()
    sig = dp.event_log.signature()
    return {
        "diff": max_abs_diff(_strip(named_grads(dp)), _strip(named_grads(ddp))),
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
    return max_abs_diff(_strip(named_grads(dp)), named_grads(ref))


def accumulation_suite(kinds: list[str]) -> dict[str, float]:
    return {kind: accumulation(kind) for kind in kinds}


# ---------------------------------------------------------------------------
# Overlap patterns
# ---------------------------------------------------------------------------


def _expect_error(fn: Callable[[], Any], *fragments: str) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        msg = str(exc)
        missing = [f for f in fragments if f not in msg]
        if missing:
            return f"message lacks {missing}: {msg}"
        return "ok"
    return "no error raised"


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
    res["forward_pending"] = _expect_error(lambda: dp(xl), "finalize_backward")
    if dp.event_log.count() != before:
        res["forward_pending"] = "a collective was issued before the error"
    # optimizer.step() while pending.
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    dp.register_optimizer(opt)
    res["step_pending"] = _expect_error(opt.step, "optimizer.step()", "finalize_backward")
    # Second synced backward while pending.
    dp.finalize_backward()
    l1 = F.mse_loss(dp(xl), yl)
    l1.backward(retain_graph=True)
    res["second_backward"] = _expect_error(lambda: l1.backward(), "finalize_backward")
    dp.finalize_backward()
    # Finalize from a hook (inside backward) before every bucket launched.
    dp2 = fresh()
    handle_holder: list[str] = []

    class Probe(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            t = t * 1.0
            t.register_hook(
                lambda g: handle_holder.append(
                    _expect_error(dp2.finalize_backward, "buckets have launched")
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
                    _expect_error(lambda: dp.set_requires_gradient_sync(False), "inside backward")
                )
            )
            t.register_hook(
                lambda g: msgs.append(
                    _expect_error(
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
    res["second_finalize_before_wait"] = _expect_error(dp.finalize_backward, "wait on the previous")
    res["forward_before_wait"] = _expect_error(lambda: dp(xl), "handle.wait()")
    h.wait()
    g1 = {k: v.clone() for k, v in named_grads(dp).items() if v is not None}
    h.wait()
    g2 = {k: v.clone() for k, v in named_grads(dp).items() if v is not None}
    res["wait_idempotent"] = "ok" if max_abs_diff(g1, g2) == 0 and h.done else "grads changed"
    res["finalize_nothing_pending"] = (
        "ok" if dp.finalize_backward() is None else "returned a handle"
    )
    # A parameter without a gradient and no find_unused_parameters: error, no hang.
    dpu = cadence.DataParallel(_TwoHeads())
    res["missing_grad"] = _expect_error(
        lambda: F.mse_loss(dpu(xl), yl).backward(), "b.weight", "find_unused_parameters=True"
    )
    res["failed_state"] = _expect_error(lambda: dpu(xl), "reset_iter_state()")
    dpu.reset_iter_state()
    dpu.module.use_b = True
    F.mse_loss(dpu(xl), yl).backward()
    res["after_reset"] = "ok" if dpu.module.a.weight.grad is not None else "no grad after reset"
    # Mismatched models across ranks: clear error at construction.
    other = make_mlp(depth=4 if rank == 0 else 3)
    res["mismatch"] = _expect_error(lambda: cadence.DataParallel(other), "different parameters")
    return res


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
        res[f"static_step{step}"] = max_abs_diff(_strip(named_grads(static)), named_grads(ref))
    plain = cadence.DataParallel(copy.deepcopy(model), bucket_cap_mb=0.001)
    x, y = global_batch(0, world)
    res["twice_error"] = _expect_error(
        lambda: F.mse_loss(
            plain(local(x, rank, world).requires_grad_()), local(y, rank, world)
        ).backward(),
        "'shared.",
        "static_graph=True",
    )
    # R4: a reentrant-checkpointed *last* layer must not finalize before the outer backward.
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
    res["ckpt_head"] = max_abs_diff(_strip(named_grads(dp)), named_grads(ref2))
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
        g = _strip(named_grads(dp))
        res[name] = max_abs_diff(g, gref)
        res[name + "_dtype_ok"] = float(all(v.dtype == torch.float32 for v in g.values()))
        res[name + "_count"] = float(dp.event_log.count("all_reduce"))
    # A torch DDP hook works unchanged (Future-returning, gets un-divided buckets).
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    dp = cadence.DataParallel(copy.deepcopy(model))
    dp.register_comm_hook(None, default_hooks.allreduce_hook)
    F.mse_loss(dp(local(x, rank, world)), local(y, rank, world)).backward()
    res["torch_hook"] = max_abs_diff(_strip(named_grads(dp)), gref)
    return res
