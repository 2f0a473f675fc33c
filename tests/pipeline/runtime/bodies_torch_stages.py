"""Rank bodies: torch's own DDP and FSDP2 modules as pipeline stages (pp 2 x dp 2)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import cadence
from cadence.models import TinyGPT
from cadence.pipeline.runtime import PlanMismatchError, build_pipeline
from cadence.pipeline.schedule import placement_for
from cadence.testing import max_abs_diff, run_subtests
from tests.pipeline.runtime.bodies_grad_sync import M, _model

__all__ = ["body_torch_stages"]


def _wrap(chunk: torch.nn.Module, wrapper: str, pg: Any) -> torch.nn.Module:
    if wrapper == "torch_ddp":
        return DDP(chunk, process_group=pg.dp)
    torch_fully_shard(chunk, mesh=pg.dp_mesh)
    return chunk


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    inner = module.module if isinstance(module, DDP) else module
    out = {}
    for k, p in inner.named_parameters():
        g = p.grad
        out[k] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def _case(pg: Any, wrapper: str, name: str) -> dict[str, Any]:
    """Two steps of the schedule on torch-wrapped stages; gradients of the second
    against one process on the whole batch (an accumulation step first)."""
    mine = sorted(s for s, r in placement_for(name, 2, 1).items() if r == pg.pp_rank)
    chunks = _model(2).split_stages(2)
    for s in mine:
        chunks[s] = _wrap(chunks[s], wrapper, pg)
    rt = build_pipeline(name, chunks, n_microbatches=M, groups=pg, loss_fn=TinyGPT.loss)
    data = cadence.models.MarkovTokens(32, 8, seed=11)
    (xa, ya), (xb, yb) = data.batch(0, 4 * M), data.batch(1, 4 * M)
    rows = pg.local_slice(xa.shape[0])
    rt.step(xa[rows], target=ya[rows], sync_gradients=False)
    rt.step(xb[rows], target=yb[rows])
    got = {f"{s}.{k}": g for s in mine for k, g in _grads(chunks[s]).items()}
    ref = _model(2)
    ref_chunks = ref.split_stages(2)
    TinyGPT.loss(ref(xa), ya).backward()
    TinyGPT.loss(ref(xb), yb).backward()
    want = {f"{s}.{k}": p.grad for s in mine for k, p in ref_chunks[s].named_parameters()}
    scale = max(float(g.abs().max()) for g in want.values())
    return {"grad_rel_diff": max_abs_diff(got, want) / scale, "n": len(got)}


def _refused(pg: Any) -> str:
    """A torch DDP stage on a zero-bubble schedule: refused on every rank, before any group."""
    chunks = _model(4).split_stages(4)
    mine = sorted(s for s, r in placement_for("zbv", 2, 2).items() if r == pg.pp_rank)
    for s in mine:
        chunks[s] = DDP(chunks[s], process_group=pg.dp)
    try:
        build_pipeline("zbv", chunks, n_microbatches=M, chunks=2, groups=pg, loss_fn=TinyGPT.loss)
    except PlanMismatchError as e:
        return str(e)
    return "no error raised"


def body_torch_stages(grid: dict) -> dict[str, Any]:
    pg = cadence.init(cadence.Topology(dp_shard=2, pp=2))
    return {"cases": run_subtests(grid, _case, pg), "refused": _refused(pg)}
