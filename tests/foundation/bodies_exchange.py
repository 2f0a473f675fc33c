"""Rank bodies for collectives by point-to-point exchange (cadence/_groups/exchange.py)."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import cadence
from cadence import CollectiveAlgorithms

EXCHANGE = CollectiveAlgorithms("exchange", "exchange", "exchange")


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0] + parts[1]
    for p in parts[2:]:
        out = out + p
    return out


def collectives(n: int = 1000, peers_in_flight: int | None = None) -> dict[str, Any]:
    """Exchange against native and against the rank-order sum computed locally
    (with ``peers_in_flight``, exchanges post that many rounds at a time)."""
    if peers_in_flight is not None:
        from cadence._groups import exchange as _exchange

        _exchange.PEERS_IN_FLIGHT = peers_in_flight
    rank, world = dist.get_rank(), dist.get_world_size()
    log = cadence.EventLog()
    ex = cadence.Comm(event_log=log, name="ex", algorithms=EXCHANGE)
    nat = cadence.Comm(name="nat", algorithms=CollectiveAlgorithms.native())
    res: dict[str, Any] = {"diff_native": {}, "exact_rank_order": {}}
    g = torch.Generator().manual_seed(100 + rank)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(world * n, generator=g).to(dtype)
        everyone = torch.empty(world * world * n, dtype=dtype)
        nat.all_gather_single(everyone, x)
        inputs = list(everyone.view(world, world * n))
        for op in ("sum", "avg"):
            key = f"{dtype}-{op}"
            want_rs = _rank_order_sum([t.view(world, n)[rank] for t in inputs])
            want_ar = _rank_order_sum(inputs)
            if op == "avg":
                want_rs, want_ar = want_rs / world, want_ar / world
            a, b = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            ex.reduce_scatter_single(a, x, op=op)
            nat.reduce_scatter_single(b, x, op=op)
            y1, y2 = x.clone(), x.clone()
            ex.all_reduce(y1, op=op)
            nat.all_reduce(y2, op=op)
            res["diff_native"][key] = max(
                (a.float() - b.float()).abs().max().item(),
                (y1.float() - y2.float()).abs().max().item(),
            )
            res["exact_rank_order"][key] = torch.equal(a, want_rs) and torch.equal(y1, want_ar)
        # In place: the output is this rank's own chunk of the input.
        xi = x.clone()
        own = xi.view(world, n)[rank]
        ex.reduce_scatter_single(own, xi)
        want = _rank_order_sum([t.view(world, n)[rank] for t in inputs])
        res[f"in_place_{dtype}"] = torch.equal(own, want)
        gathered = torch.empty(world * n, dtype=dtype)
        ex.all_gather_single(gathered, x[:n])
        res[f"all_gather_{dtype}"] = torch.equal(gathered, torch.cat([t[:n] for t in inputs]))
    res["algorithms_logged"] = sorted(
        {e.meta.get("algorithm", "native") for e in log.collectives()}
    )
    res["counts"] = log.counts()
    return res


def interleaved() -> dict[str, Any]:
    """Several exchanges in flight at once, a user's tag-0 send/recv on the same group
    between them, waited in reverse order: every result lands in the right buffer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = cadence.Comm(algorithms=EXCHANGE)
    shard = torch.full((3,), float(rank))
    gathered = [torch.empty(3 * world) for _ in range(2)]
    w1 = comm.all_gather_single(gathered[0], shard, async_op=True)
    rs_out = torch.empty(4)
    w2 = comm.reduce_scatter_single(rs_out, torch.arange(4.0 * world) + rank, async_op=True)
    # A user's own point-to-point message on the same group, default tag 0.
    user = torch.full((5,), float(rank))
    peer = (rank + 1) % world
    got = torch.empty(5)
    u_send = dist.isend(user, peer)
    u_recv = dist.irecv(got, (rank - 1) % world)
    w3 = comm.all_gather_single(gathered[1], shard + 10, async_op=True)
    for w in (w3, w2, w1):
        w.wait()
    u_send.wait()
    u_recv.wait()
    want_rs = sum(torch.arange(4.0 * world).view(world, 4)[rank] + r for r in range(world))
    # Completion is reported without anyone calling wait(), with the sum already in place.
    polled = torch.empty(4)
    w4 = comm.reduce_scatter_single(polled, torch.arange(4.0 * world) + rank, async_op=True)
    deadline = time.monotonic() + 30
    while not w4.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    completes_by_itself = w4.is_completed() and torch.equal(polled, want_rs)
    w4.wait()
    return {
        "ag0": gathered[0].tolist() == [float(r) for r in range(world) for _ in range(3)],
        "ag1": gathered[1].tolist() == [float(r + 10) for r in range(world) for _ in range(3)],
        "rs": torch.equal(rs_out, want_rs),
        "user": got.tolist() == [float((rank - 1) % world)] * 5,
        "completes_without_wait": completes_by_itself,
    }


def fallbacks() -> dict[str, Any]:
    """Ops and layouts the exchange does not cover run natively (and are logged so)."""
    world = dist.get_world_size()
    log = cadence.EventLog()
    comm = cadence.Comm(event_log=log, algorithms=EXCHANGE)
    t = torch.full((4,), float(dist.get_rank()))
    comm.all_reduce(t, op="max")
    out = torch.empty(2 * world, 3)[:, 0]  # not contiguous
    comm.all_gather_single(out, torch.ones(2))
    return {
        "max": t.tolist() == [float(world - 1)] * 4,
        "gathered": out.tolist() == [1.0] * (2 * world),
        "algorithms": [e.meta.get("algorithm", "native") for e in log.collectives()],
    }


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
    )


def _train(model: nn.Module, steps: int = 3) -> list[torch.Tensor]:
    rank = dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _fsdp(base: nn.Module, algorithms: CollectiveAlgorithms) -> list[torch.Tensor]:
    model = copy.deepcopy(base)
    log = cadence.EventLog()
    for layer in (model[0], model[2]):
        cadence.fully_shard(layer, event_log=log)
    cadence.fully_shard(model, event_log=log)
    model.set_collective_algorithms(algorithms)
    params = _train(model)
    used = {f"{e.kind}:{e.meta.get('algorithm', 'native')}" for e in log.collectives()}
    return [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params] + [used]  # type: ignore[list-item]


def wrappers() -> dict[str, Any]:
    """fully_shard and DataParallel train to the same parameters either way."""
    base = _mlp()
    *exchanged, exchange_used = _fsdp(base, EXCHANGE)
    *native, native_used = _fsdp(base, CollectiveAlgorithms.native())
    res: dict[str, Any] = {
        "fsdp_max_diff": max((a - b).abs().max().item() for a, b in zip(exchanged, native)),
        "fsdp_exchange_used": sorted(exchange_used),
        "fsdp_native_used": sorted(native_used),
    }
    try:
        cadence.fully_shard(copy.deepcopy(base)).set_collective_algorithms("native")  # type: ignore[arg-type]
    except TypeError as e:
        res["fsdp_type_error"] = str(e)
    dp_native = _train(cadence.DataParallel(copy.deepcopy(base)))
    dp = cadence.DataParallel(copy.deepcopy(base))
    dp.set_collective_algorithms(CollectiveAlgorithms(all_reduce="exchange"))
    dp_exchange = _train(dp)
    res["dp_max_diff"] = max((a - b).abs().max().item() for a, b in zip(dp_native, dp_exchange))
    manual = cadence.DataParallel(copy.deepcopy(base))
    manual.require_manual_backward_finalization = True
    manual(torch.randn(4, 16)).sum().backward()
    try:
        manual.set_collective_algorithms(CollectiveAlgorithms.native())
    except cadence.CadenceError as e:
        res["dp_pending_error"] = str(e)
    manual.finalize_backward()
    try:
        dp.set_collective_algorithms("exchange")  # type: ignore[arg-type]
    except TypeError as e:
        res["dp_type_error"] = str(e)
    # Inside backward (from a hook): refused, since the ranks could switch at different units.
    sharded = copy.deepcopy(base)
    cadence.fully_shard(sharded)
    out = sharded(torch.randn(4, 16))
    out.register_hook(lambda g: sharded.set_collective_algorithms(CollectiveAlgorithms()))
    try:
        out.sum().backward()
    except cadence.CadenceError as e:
        res["fsdp_in_backward_error"] = str(e)
    sharded.reset_iter_state()
    return res
