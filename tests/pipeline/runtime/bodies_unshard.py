"""Rank bodies of the UNSHARD/RESHARD placement tests (pp 2 x dp 2, fully_shard stages)."""

from __future__ import annotations

import torch

import cadence
from cadence import EventLog
from cadence.fsdp import fully_shard
from cadence.models import GPTConfig, MarkovTokens, TinyGPT
from cadence.models.gpt import Block
from cadence.pipeline.runtime import build_pipeline
from cadence.pipeline.schedule import placement_for
from cadence.testing import max_abs_diff, run_subtests

M = 4  # microbatches per step
BLOCKS = 2  # per stage: each its own fully_shard unit under the stage's root unit


def _model(n_stages: int) -> TinyGPT:
    torch.manual_seed(3)
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=BLOCKS * n_stages)
    return TinyGPT(cfg)


def _shard(chunk: torch.nn.Module, pg, log: EventLog) -> torch.nn.Module:
    # As `cadence train --fsdp` wraps a stage: each block, then the stage.
    for block in [m for m in chunk.modules() if isinstance(m, Block)]:
        fully_shard(block, group=pg, event_log=log)
    return fully_shard(chunk, group=pg, event_log=log)


def placement_case(pg, name_v: tuple[str, int], lookahead: int | None) -> dict:
    """Two steps; the second one's all-gathers, and its gradients against one process."""
    name, v = name_v
    n = 2 * v
    mine = sorted(s for s, r in placement_for(name, 2, v).items() if r == pg.pp_rank)
    log = EventLog()
    chunks = _model(n).split_stages(n)
    stages = {s: _shard(chunks[s], pg, log) for s in mine}
    rt = build_pipeline(
        name,
        stages,
        n_microbatches=M,
        chunks=v,
        groups=pg,
        loss_fn=TinyGPT.loss,
        event_log=log,
        unshard_lookahead=lookahead,
    )
    x, y = MarkovTokens(32, 8, seed=4).batch(0, 4 * M)
    rows = pg.local_slice(x.shape[0])
    rt.step(x[rows], target=y[rows])
    for st in stages.values():
        st.zero_grad()
    log.clear()
    rt.step(x[rows], target=y[rows])
    got = {f"{s}.{k}": p.grad.full_tensor() for s in mine for k, p in stages[s].named_parameters()}
    ref = _model(n).split_stages(n)
    TinyGPT.loss(torch.nn.Sequential(*ref)(x), y).backward()
    want = {f"{s}.{k}": p.grad for s in mine for k, p in ref[s].named_parameters()}
    scale = max(float(g.abs().max()) for g in want.values())
    return {
        "all_gathers": log.count("all_gather"),
        # Units that own parameters: one without any gathers nothing (as FSDP2's).
        "units": sum(1 for st in stages.values() for u in st._units(recurse=True) if u.params),
        "unshard_actions": sum(a.kind.name == "UNSHARD" for a in rt.actions),
        "grad_rel_diff": max_abs_diff(got, want) / scale,
        "grads": {k: g.clone() for k, g in got.items()},
        "unsharded_bytes_after": sum(
            st.memory_stats()["unsharded_param_bytes"] for st in stages.values()
        ),
    }


def body_unshard(grid: dict) -> dict:
    pg = cadence.init(cadence.Topology(dp_shard=2, pp=2))
    return run_subtests(grid, placement_case, pg)
