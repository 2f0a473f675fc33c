"""Rank bodies for HSDP (2 x 2 at world 4) and DCP resharding across world sizes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import cadence
from cadence.testing import max_abs_diff, run_subtests
from tests.fsdp.common import (
    apply_cadence,
    loss_fn,
    make_batches,
    make_blocks,
    make_mlp,
    reference_steps,
)

__all__ = ["cuda_body", "dcp_load_body", "dcp_save_body", "hsdp_body"]

_X = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))


def _mlp_units(m: Any) -> list[Any]:
    return [m[0], m[2], m[4]]


def _trained_mlp() -> Any:
    """An MLP whose weights differ from make_mlp()'s: a fresh load must change them."""
    m = make_mlp()
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.add_(0.01 * (i + 1))
    return m


def dcp_save_body(path: str) -> list[float]:
    m = _trained_mlp()
    m = apply_cadence(m, _mlp_units(m))
    dcp.save(m.state_dict(), checkpoint_id=path)
    with torch.no_grad():
        return m(_X).flatten().tolist()


def dcp_load_body(path: str, save_to: str | None = None) -> list[float]:
    m = make_mlp()
    m = apply_cadence(m, _mlp_units(m))
    sd = m.state_dict()
    dcp.load(sd, checkpoint_id=path)
    m.load_state_dict(sd)
    if save_to is not None:
        dcp.save(m.state_dict(), checkpoint_id=save_to)
    with torch.no_grad():
        return m(_X).flatten().tolist()


def _hsdp_run(
    pg: Any, before: Callable[[Any, int, bool], None], finalize: str | None
) -> tuple[float, list[tuple[int, int, int]]]:
    rank = pg.coords.dp_replicate * pg.topology.dp_shard + pg.coords.dp_shard
    world = pg.topology.dp_size
    batches = make_batches("blocks", 2, 8)
    ref = reference_steps(make_blocks(), batches)
    log = cadence.EventLog()
    m = make_blocks()
    m = apply_cadence(m, m.units(), group=pg, event_log=log)
    if finalize is not None:
        m.set_manual_backward_finalization(True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    counts = []
    for batch in batches:
        for i, mb in enumerate(batch.chunk(world)[rank].chunk(2)):
            before(m, i, i == 1)
            log.clear()
            (loss_fn(m, mb) / 2).backward()
            counts.append(
                (log.count("all_gather"), log.count("reduce_scatter"), log.count("all_reduce"))
            )
        if finalize is not None:
            m.set_requires_gradient_sync(True)
            handle = m.finalize_backward(async_op=finalize == "async")
            if handle is not None:
                handle.wait()
        opt.step()
        opt.zero_grad()
    return max_abs_diff(m.full_state_dict(), ref), counts


def hsdp_body(dcp_path: str, dcp_path_back: str) -> dict[str, Any]:
    topo = cadence.Topology(dp_replicate=2, dp_shard=2, pp=1)
    pg = topo.build()
    out: dict[str, Any] = {}
    nothing = lambda m, i, last: None  # noqa: E731
    nosync = lambda m, i, last: m.set_requires_gradient_sync(last)  # noqa: E731
    never = lambda m, i, last: m.set_requires_gradient_sync(False)  # noqa: E731
    modes = {
        "every": (nothing, None),
        "nosync": (nosync, None),
        "deferred_sync": (never, "sync"),
        "deferred_async": (never, "async"),
        "manual_sync_last": (nosync, "async"),
        # set_requires_all_reduce(False): reduce-scatter only; the last one all-reduces.
        "no_all_reduce": (lambda m, i, last: m.set_requires_all_reduce(last), None),
    }
    runs = run_subtests({"mode": list(modes)}, lambda mode: _hsdp_run(pg, *modes[mode]))
    for name in modes:
        out[f"hsdp_{name}_parity"], out[f"hsdp_{name}_counts"] = runs[f"mode={name!r}"]
    m = make_blocks()
    m = apply_cadence(m, m.units(), group=pg)
    out["hsdp_placements"] = str(m.head.weight.placements)
    # DCP: the world-2 checkpoint loads into a world-4 sharded model.
    out["dcp_ws4_outputs"] = dcp_load_body(dcp_path, save_to=dcp_path_back)
    out["dcp_ws4_local_rows"] = make_mlp_sharded_rows()
    return out


def make_mlp_sharded_rows() -> int:
    m = make_mlp()
    m = apply_cadence(m, _mlp_units(m))
    return int(m[0].weight.to_local().shape[0]) if dist.get_rank() == 3 else -1


def cuda_body() -> dict[str, float]:
    """World 1 on NCCL: the stream/event path end to end (runs only where a GPU exists)."""
    import copy

    from tests.fsdp.common import full_params, train_steps

    device = torch.device("cuda", 0)
    batches = [b.to(device) for b in make_batches("blocks", 3, 8)]
    base = make_blocks().to(device)
    ref = copy.deepcopy(base)
    train_steps(ref, batches, 0, 1)
    m = apply_cadence(base, base.units(), unit_raf=True)
    m.set_manual_backward_finalization(True)
    m.set_max_inflight_reductions(2)

    def finalize() -> None:
        handle = m.finalize_backward(async_op=True)
        handle.wait()

    train_steps(m, batches, 0, 1, after_backward=finalize)
    torch.cuda.synchronize()
    expected = {n: p.detach() for n, p in ref.named_parameters()}
    return {"cuda_parity": max_abs_diff(full_params(m), expected)}
