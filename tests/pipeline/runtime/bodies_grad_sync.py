"""Rank bodies of the pp=2 x dp=2 tests: data-parallel stages inside a pipeline."""

from __future__ import annotations

import torch

import cadence
from cadence import EventLog
from cadence.fsdp import fully_shard
from cadence.models import GPTConfig, MarkovTokens, TinyGPT
from cadence.pipeline.runtime import PlanMismatchError, build_pipeline
from cadence.pipeline.schedule import placement_for
from cadence.testing import max_abs_diff, run_subtests


def _model(n: int) -> TinyGPT:
    torch.manual_seed(7)
    return TinyGPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=n))


def pp_dp_case(pg, wrapper: str, name: str, v: int = 2, m: int = 4) -> dict:
    """An accumulation step, then a syncing step; gradients against one process."""
    n = 2 * v
    mine = sorted(s for s, r in placement_for(name, 2, v).items() if r == pg.pp_rank)
    log = EventLog()
    chunks = _model(n).split_stages(n)
    for s in mine:
        if wrapper == "fully_shard":
            fully_shard(chunks[s], group=pg, event_log=log)
        else:
            # The same runtime drives DataParallel through the same public verbs.
            chunks[s] = cadence.DataParallel(chunks[s], group=pg, event_log=log)
    reduce_kind = "reduce_scatter" if wrapper == "fully_shard" else "all_reduce"
    rt = build_pipeline(
        name, chunks, n_microbatches=m, chunks=v, groups=pg, loss_fn=TinyGPT.loss, event_log=log
    )
    data = MarkovTokens(32, 8, seed=11)
    (xa, ya), (xb, yb) = data.batch(0, 4 * m), data.batch(1, 4 * m)
    rows = pg.local_slice(xa.shape[0])
    log.clear()
    # an accumulation step (no reduction), then a syncing step: reduced once, scaled once
    rt.step(xa[rows], target=ya[rows], sync_gradients=False)
    n_reductions_after_first = log.count(reduce_kind)
    rt.step(xb[rows], target=yb[rows])
    got = {}
    for s in mine:
        inner = chunks[s].module if wrapper == "data_parallel" else chunks[s]
        for k, p in inner.named_parameters():
            g = p.grad
            got[f"{s}.{k}"] = g.full_tensor() if hasattr(g, "full_tensor") else g
    ref = _model(n)
    ref_chunks = ref.split_stages(n)
    TinyGPT.loss(ref(xa), ya).backward()
    TinyGPT.loss(ref(xb), yb).backward()
    want = {f"{s}.{k}": p.grad for s in mine for k, p in ref_chunks[s].named_parameters()}
    red = log.collectives(reduce_kind)
    return {
        "grad_diff": max_abs_diff(got, want),
        "n_grads": len(got),
        "reductions": len(red),
        "reductions_after_accumulation_step": n_reductions_after_first,
        "history": {s: rt._sync[s].history for s in mine},
        "all_waited": all(e.waited for e in red),
        # the first stage's reduction was still open when the next one was issued
        "overlapped": len(red) >= 2 and red[0].wait_end_t >= red[1].issue_t,
    }


def split_backward_refused(pg, wrapper: str) -> str:
    """A wrapped stage on a schedule with I/W split: refused on every rank, no hang."""
    chunks = _model(4).split_stages(4)
    mine = [s for s, r in placement_for("zbv", 2, 2).items() if r == pg.pp_rank]
    stages = {
        s: fully_shard(chunks[s], group=pg)
        if wrapper == "fully_shard"
        else cadence.DataParallel(chunks[s], group=pg)
        for s in mine
    }
    try:
        build_pipeline("zbv", stages, n_microbatches=4, chunks=2, groups=pg, loss_fn=TinyGPT.loss)
    except PlanMismatchError as e:
        return str(e)
    return "no error"


def body_pp2_dp2(grid: dict) -> dict:
    pg = cadence.init(cadence.Topology(dp_shard=2, pp=2))
    return {
        "parity": run_subtests(grid, pp_dp_case, pg),
        "refused": run_subtests({"wrapper": grid["wrapper"]}, split_backward_refused, pg),
    }
