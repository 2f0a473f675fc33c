"""Runtime behaviour at world 2, in one launch: errors, accumulation, eval, divergence,
and the channel/LOCAL accounting of looped and V placements."""

from __future__ import annotations

import torch
import torch.distributed as dist
from test_parity_schedules import SOURCE

from cadence import EventLog
from cadence.models import GPTConfig, MarkovTokens, TinyGPT
from cadence.pipeline._build import build_pipeline, placement_for
from cadence.pipeline.groups import PlanMismatchError
from cadence.pipeline.runtime import PipelineRuntime
from cadence.pipeline.stage import PipelineStage
from cadence.testing import max_abs_diff, named_grads, run_distributed


def _model(n_stages: int) -> TinyGPT:
    torch.manual_seed(99)
    return TinyGPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=n_stages))


def _grads(chunks, mine):
    return {f"{s}.{k}": g for s in mine for k, g in named_grads(chunks[s]).items()}


def _mine(name, v):
    pl = placement_for(name, dist.get_world_size(), v)
    return sorted(s for s, r in pl.items() if r == dist.get_rank())


def body_behaviour(name: str, v: int):
    p = dist.get_world_size()
    n, m = p * v, 2 * p
    out: dict = {}
    x, y = MarkovTokens(32, 8, seed=5).batch(0, 4 * m)
    mine = _mine(name, v)

    # 1. an uneven batch fails at step(), before any communication, naming the fix
    chunks = _model(n).split_stages(n)
    rt = build_pipeline(
        name, chunks, n_microbatches=m, chunks=v, loss_fn=TinyGPT.loss, source=SOURCE
    )
    try:
        rt.step(x[:-1], target=y[:-1])
        out["uneven"] = "no error"
    except ValueError as e:
        out["uneven"] = str(e)

    # 2. accumulation over two steps without zero_grad == the reference's (scaled once)
    x2, y2 = MarkovTokens(32, 8, seed=5).batch(1, 4 * m)
    rt.step(x, target=y)
    rt.step(x2, target=y2)
    ref = _model(n)
    ref_chunks = ref.split_stages(n)
    TinyGPT.loss(ref(x), y).backward()
    TinyGPT.loss(ref(x2), y2).backward()
    out["accum_grad_diff"] = max_abs_diff(_grads(chunks, mine), _grads(ref_chunks, mine))

    # 3. eval: forward only, outputs equal the reference, gradients untouched
    before = _grads(chunks, mine)
    losses: list = []
    logits = rt.eval(x, target=y, losses=losses)
    out["eval_grads_untouched"] = max_abs_diff(_grads(chunks, mine), before)
    if logits is not None:
        with torch.no_grad():
            out["eval_logits_diff"] = float((logits - ref(x)).abs().max())
            out["eval_loss_diff"] = abs(
                float(torch.stack(losses).mean()) - float(TinyGPT.loss(ref(x), y))
            )

    # 4. a lowered schedule that fails the simulator is refused on every rank,
    #    before any group: here rank 1 posts its receives out of FIFO order
    if SOURCE == "cadence":
        import dataclasses

        from cadence.pipeline import generators, passes

        low = passes.lower(generators.generate("gpipe", p, 2))
        r_last = list(low.ranks[p - 1])
        a, b = r_last[0], r_last[2]  # RECV_F0, (F0), RECV_F1
        r_last = [dataclasses.replace(a, mb=1), dataclasses.replace(b, mb=0), r_last[1], r_last[3]]
        bad = low.with_ranks([*low.ranks[: p - 1], r_last + list(low.ranks[p - 1][4:])])
        try:
            build_pipeline(bad, _model(p).split_stages(p), n_microbatches=2, loss_fn=TinyGPT.loss)
            out["refused"] = "accepted"
        except Exception as e:
            out["refused"] = f"{type(e).__name__}: {e}"

    # 5. channels and LOCAL hand-offs as recorded, against the plan
    log = EventLog()
    chunks = _model(n).split_stages(n)
    rt = build_pipeline(
        name, chunks, n_microbatches=m, chunks=v, loss_fn=TinyGPT.loss, event_log=log, source=SOURCE
    )
    log.clear()  # drop the setup traffic: count one step
    rt.step(x, target=y)
    p2p = [e for e in log.collectives() if e.kind in ("send", "recv")]
    out["recorded_channels"] = sorted({e.group for e in p2p})
    out["plan_channels"] = [f"pp{a}->{b}" for a, b in rt.channels]
    planned = [o for o in rt.local_ops if o.kind in ("SEND", "RECV")]
    out["op_channel_matches"] = len(planned) == len(p2p) and all(
        e.group == f"pp{o.channel[0]}->{o.channel[1]}" and e.kind == o.kind.lower()
        for o, e in zip(planned, p2p)
    )
    locals_ = log.marks("pp_local")
    out["local_fwd"] = sum(1 for e in locals_ if not e.meta["grad"])
    out["local_bwd"] = sum(1 for e in locals_ if e.meta["grad"])
    out["local_pairs"] = sorted({(e.meta["src"], e.meta["dst"]) for e in locals_})
    return out


def body_diverge():
    """Rank 1 is handed the stages of a different placement: every rank fails fast."""
    rank = dist.get_rank()
    chunks = _model(4).split_stages(4)
    ops = {0: [], 1: []}
    placement = {0: 0, 1: 1, 2: 0, 3: 1}
    wrong = [2, 3] if rank == 1 else [0, 2]  # rank 1 builds V-style stages
    stages = [PipelineStage(chunks[s], s, 4) for s in wrong]
    try:
        PipelineRuntime(ops, placement, 2, stages, loss_fn=TinyGPT.loss)
    except PlanMismatchError as e:
        return str(e)
    return "no error"


def test_runtime_behaviour_interleaved_and_v():
    results = run_distributed(_behaviours, world_size=2, timeout=120)
    for rank, res in enumerate(results):
        for name, out in res.items():
            assert "does not split into" in out["uneven"] and "multiple of" in out["uneven"], out
            assert out["accum_grad_diff"] <= 1e-6, (name, out["accum_grad_diff"])
            assert out["eval_grads_untouched"] == 0.0
            if "eval_logits_diff" in out:
                assert out["eval_logits_diff"] <= 1e-5 and out["eval_loss_diff"] <= 1e-6
            assert out["op_channel_matches"], (name, rank)
            assert set(out["recorded_channels"]) <= set(out["plan_channels"])
            if "refused" in out:
                assert out["refused"].startswith("FifoMismatchError"), out["refused"]
        # looped placement at world 2: the wrap-around 1 -> 2 is channel (1 -> 0)
        assert "pp1->0" in res["interleaved"]["recorded_channels"]
        assert res["interleaved"]["local_pairs"] == []
        # V turn: stage 1 -> 2 lives on rank 1; m LOCAL hand-offs each way, no P2P
        zbv = res["zbv"]
        if rank == 1:
            assert zbv["local_fwd"] == 4 and zbv["local_bwd"] == 4, zbv
            assert zbv["local_pairs"] == [(1, 2), (2, 1)]
        else:
            assert zbv["local_fwd"] == 0 and zbv["local_bwd"] == 0


def _behaviours():
    return {name: body_behaviour(name, 2) for name in ("interleaved", "zbv")}


def test_divergent_placement_fails_fast_everywhere():
    results = run_distributed(body_diverge, world_size=2, timeout=30)
    assert "no error" not in results
    assert all("pipeline setup failed" in r and "rank 1" in r for r in results), results
