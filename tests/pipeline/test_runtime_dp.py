"""pp=2 x dp=2 at world 4: stages wrapped in a data-parallel wrapper; the runtime uses
only the public timing verbs, and REDUCE_GRAD's wait is deferred."""

from __future__ import annotations

import pytest
import torch
from test_parity_schedules import SOURCE

import cadence
from cadence import EventLog
from cadence.fsdp import fully_shard
from cadence.models import GPTConfig, MarkovTokens, TinyGPT
from cadence.pipeline._build import build_pipeline, placement_for
from cadence.testing import max_abs_diff, run_distributed


def _model(n: int) -> TinyGPT:
    torch.manual_seed(7)
    return TinyGPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=n))


def body_pp_dp(name: str, v: int, m: int, wrapper: str = "fully_shard"):
    pg = cadence.init(cadence.Topology(dp_shard=2, pp=2))
    n = 2 * v
    placement = placement_for(name, 2, v)
    pp_rank = pg.coords.pp
    mine = sorted(s for s, r in placement.items() if r == pp_rank)
    log = EventLog()
    chunks = _model(n).split_stages(n)
    for s in mine:
        if wrapper == "fully_shard":
            fully_shard(chunks[s], group=pg.dp_shard, event_log=log)
        else:
            # The same runtime drives DataParallel through the same public verbs.
            chunks[s] = cadence.DataParallel(chunks[s], group=pg.dp, event_log=log)
    reduce_kind = "reduce_scatter" if wrapper == "fully_shard" else "all_reduce"
    rt = build_pipeline(
        name,
        chunks,
        n_microbatches=m,
        chunks=v,
        groups=pg,
        loss_fn=TinyGPT.loss,
        event_log=log,
        source=SOURCE,
    )
    data = MarkovTokens(32, 8, seed=11)
    (xa, ya), (xb, yb) = data.batch(0, 4 * m), data.batch(1, 4 * m)
    half = xa.shape[0] // 2
    d = pg.coords.dp_shard
    mine_rows = slice(d * half, (d + 1) * half)
    log.clear()
    # an accumulation step (no reduction), then a syncing step: reduced once, scaled once
    rt.step(xa[mine_rows], target=ya[mine_rows], sync_gradients=False)
    n_rs_after_first = log.count(reduce_kind)
    rt.step(xb[mine_rows], target=yb[mine_rows])
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
    order = [
        (e.kind if e.kind != "mark" else e.group, e.meta.get("stage"))
        for e in log.events
        if e.kind in (reduce_kind, "mark") and e.group != "pp_local"
    ]
    rs = log.collectives(reduce_kind)
    return {
        "grad_diff": max_abs_diff(got, want),
        "n_grads": len(got),
        "order": order,
        "reduce_scatters": len(rs),
        "reduce_scatters_after_accumulation_step": n_rs_after_first,
        "history": {s: rt._sync[s].history for s in mine},
        "all_waited": all(e.waited for e in rs),
        # the first stage's reduction was still open when the next one was issued
        "overlapped": len(rs) >= 2 and rs[0].wait_end_t >= rs[1].issue_t,
    }


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["fully_shard", "data_parallel"])
def test_pp2_dp2_parity_and_deferred_wait(wrapper: str):
    results = run_distributed(body_pp_dp, "interleaved", 2, 4, wrapper, world_size=4, timeout=120)
    for rank, r in enumerate(results):
        assert r["n_grads"] > 0
        assert r["grad_diff"] <= 1e-6, (rank, r["grad_diff"])
        assert r["all_waited"], rank
        assert r["reduce_scatters"] == len(r["history"]), r  # one per stage per step
        assert r["overlapped"], r["order"]
        assert r["reduce_scatters_after_accumulation_step"] == 0, r
        # each local stage reduced once and waited once, in that order
        for s, h in r["history"].items():
            assert h == ["reduce", "wait"], (rank, s, h)
