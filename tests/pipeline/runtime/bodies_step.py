"""Rank bodies of the runtime behaviour tests (world 2, one launch for all of them)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

import cadence
from cadence import EventLog
from cadence.models import GPTConfig, MarkovTokens, TinyGPT
from cadence.pipeline.runtime import (
    PipelineRuntime,
    PipelineRuntimeError,
    PlanMismatchError,
    Stage,
    TensorMeta,
    build_pipeline,
)
from cadence.pipeline.schedule import (
    ActionKind,
    Schedule,
    generate,
    lower,
    placement_for,
)
from cadence.testing import max_abs_diff, named_grads, run_subtests
from tests.pipeline.runtime.bodies_channel_modes import mode_case
from tests.pipeline.runtime.bodies_groups import body_diverge
from tests.pipeline.runtime.bodies_parity import per_channel, recv_timing


def _model(n_stages: int) -> TinyGPT:
    torch.manual_seed(99)
    return TinyGPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=n_stages))


def _grads(chunks, mine):
    return {f"{s}.{k}": g for s in mine for k, g in named_grads(chunks[s]).items()}


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def behaviour(name: str, v: int) -> dict:
    """Uneven batch, accumulation, eval, and the channel/LOCAL accounting of one schedule."""
    p = dist.get_world_size()
    n, m = p * v, 2 * p
    out: dict = {}
    x, y = MarkovTokens(32, 8, seed=5).batch(0, 4 * m)
    mine = sorted(s for s, r in placement_for(name, p, v).items() if r == dist.get_rank())

    # 1. an uneven batch fails at step(), before any communication, naming the fix
    chunks = _model(n).split_stages(n)
    log = EventLog()
    rt = build_pipeline(
        name, chunks, n_microbatches=m, chunks=v, loss_fn=TinyGPT.loss, event_log=log
    )
    out["uneven"] = _error(lambda: rt.step(x[:-1], target=y[:-1]))

    # 2. accumulation over two steps without zero_grad == the reference's (scaled once);
    #    the first step's traffic is recorded against the plan
    x2, y2 = MarkovTokens(32, 8, seed=5).batch(1, 4 * m)
    log.clear()  # drop the setup traffic: count one step
    rt.step(x, target=y)
    p2p = [e for e in log.collectives() if e.kind in ("send", "recv")]
    planned = [a for a in rt.actions if a.kind in (ActionKind.SEND, ActionKind.RECV)]
    out["recorded_channels"] = sorted({e.group for e in p2p})
    out["plan_channels"] = [f"pp{a}->{b}" for a, b in rt.plan.edges]
    # per channel, the planned ops in the planned order (receives may be posted ahead)
    out["op_channel_matches"] = per_channel(
        (f"pp{a.channel[0]}->{a.channel[1]}", a.kind.name.lower(), a.mb) for a in planned
    ) == per_channel((e.group, e.kind, None) for e in p2p)
    out["recv_timing"] = recv_timing(rt.actions, log)
    locals_ = log.marks("pp_local")
    out["local_fwd"] = sum(1 for e in locals_ if not e.meta["grad"])
    out["local_bwd"] = sum(1 for e in locals_ if e.meta["grad"])
    out["local_pairs"] = sorted({(e.meta["src"], e.meta["dst"]) for e in locals_})
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
    return out


def fifo_swap_refused() -> str:
    """A lowered schedule whose last rank posts its receives out of FIFO order is
    refused by the simulator on every rank, before any group."""
    p = dist.get_world_size()
    low = lower(generate("gpipe", p, 2))
    r_last = list(low.ranks[p - 1])
    a, b = r_last[0], r_last[2]  # RECV_F0, (F0), RECV_F1
    swapped = [dataclasses.replace(a, mb=1), dataclasses.replace(b, mb=0), r_last[1], r_last[3]]
    bad = low.with_ranks([*low.ranks[: p - 1], swapped + r_last[4:]])
    return _error(
        lambda: build_pipeline(
            bad, _model(p).split_stages(p), n_microbatches=2, loss_fn=TinyGPT.loss
        )
    )


def diverge() -> str:
    """Rank 1 is handed the stages of a different placement: every rank fails fast."""
    rank = dist.get_rank()
    chunks = _model(4).split_stages(4)
    low = lower(generate("interleaved", 2, 2, 2))  # places stages {0, 2} and {1, 3}
    wrong = [2, 3] if rank == 1 else [0, 2]  # rank 1 builds V-style stages
    stages = [Stage(chunks[s], s, 4) for s in wrong]
    try:
        PipelineRuntime(low, stages, loss_fn=TinyGPT.loss)
    except PlanMismatchError as e:
        return str(e)
    return "no error"


def misuse() -> dict[str, str]:
    """Arguments the runtime cannot honour: refused locally, before any collective."""
    p = dist.get_world_size()
    chunks = _model(2 * p).split_stages(2 * p)
    low = lower(generate("interleaved", p, 2 * p, 2))

    def build(schedule, **kw):
        kw.setdefault("loss_fn", TinyGPT.loss)
        return lambda: build_pipeline(schedule, chunks, **kw)

    mine = [Stage(chunks[s], s, 2 * p) for s in low.stages_of(dist.get_rank())]
    return {
        "no_m": _error(build("interleaved", chunks=2)),
        "m_mismatch": _error(build(low, n_microbatches=3)),
        "chunks_mismatch": _error(build(low, chunks=1)),
        "torch_source_schedule": _error(build(low, source="torch")),
        "torch_source_gpipe": _error(build("gpipe", n_microbatches=2, source="torch")),
        "bad_source": _error(build("gpipe", n_microbatches=2, source="jax")),
        "k_zero": _error(build("gpipe", n_microbatches=2, max_outstanding_reductions=0)),
        "k_lowered": _error(build(low, max_outstanding_reductions=2)),
        "lookahead_negative": _error(build("gpipe", n_microbatches=2, unshard_lookahead=-1)),
        "lookahead_bool": _error(build("gpipe", n_microbatches=2, unshard_lookahead=True)),
        "lookahead_lowered": _error(build(low, unshard_lookahead=1)),
        "tie_one_stage": _error(build(low, tied_parameters=[[(0, "a"), (0, "b")]])),
        "tie_no_param": _error(build(low, tied_parameters=[[(0, "nope"), (1, "nope")]])),
        "stage_count": _error(lambda: build_pipeline("1f1b", chunks[:3], n_microbatches=2)),
        "missing_stage": _error(lambda: build_pipeline(low, {0: chunks[0]})),
        "bad_input_meta": _error(build(low, input_meta={9: TensorMeta((1,), torch.float32)})),
        "bad_mode": _error(lambda: PipelineRuntime(low, mine, channel_mode="ring")),  # type: ignore[arg-type]
        "compute_only": _error(lambda: PipelineRuntime(generate("gpipe", p, 2), mine)),
        "wrong_pp": _error(lambda: PipelineRuntime(lower(generate("gpipe", 2 * p, 4)), mine)),
        "not_a_schedule": _error(lambda: PipelineRuntime({0: []}, mine)),  # type: ignore[arg-type]
    }


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


def error_report() -> tuple[str, int, str]:
    """A one-rank pipeline (each rank its own) whose second stage has wrong metadata."""
    pg = cadence.init(cadence.Topology(dp_replicate=dist.get_world_size()))
    stages = [
        Stage(_mlp(0), 0, 2, output_meta=TensorMeta((2, 8), torch.float32)),
        Stage(
            _mlp(1),
            1,
            2,
            input_meta=TensorMeta((2, 7), torch.float32),
            output_meta=TensorMeta((2, 8), torch.float32),
        ),
    ]
    sched = Schedule.from_lists(
        [["0F0", "0LOCAL_F0~1", "1F0", "1B0", "1LOCAL_B0~0", "0B0"]], placement=[0, 0]
    )
    rt = PipelineRuntime(sched, stages, loss_fn=lambda o, t: (o - t).pow(2).mean(), groups=pg)
    try:
        rt.step(torch.randn(2, 8), target=torch.randn(2, 8))
    except PipelineRuntimeError as e:
        return str(e), e.index, str(e.action)
    return "no error", -1, ""


def body_runtime_world2() -> dict:
    """Everything above in one launch (a process start costs more than each check)."""
    return {
        "behaviour": run_subtests({"name": ["interleaved", "zbv"]}, behaviour, v=2),
        # per-direction groups at world 2 (pp 4 and pp 2 x dp 2: test_channel_modes.py)
        "channel_modes": run_subtests(
            {"name_v": [("1f1b", 1), ("interleaved", 2), ("zbv", 2)]},
            lambda name_v: mode_case(*name_v, pg=None),
        ),
        "fifo_swap": fifo_swap_refused(),
        "diverge": diverge(),
        "diverge_channels": body_diverge(),
        "misuse": misuse(),
        "error_report": error_report(),
    }
