"""Rank bodies of the parity tests: every schedule against one process and torch.

One ``run_distributed`` launch per world size runs every (schedule, m) config
through `run_subtests`: a process start costs ~2 s on the CI machine, a config
well under that. Each rank returns its numbers; the parent asserts, so a failure
names the config.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cadence import EventLog
from cadence.models import GPTConfig, MarkovTokens, TinyGPT
from cadence.pipeline.runtime import build_pipeline
from cadence.pipeline.schedule import ActionKind, placement_for, torch_schedule_name
from cadence.testing import max_abs_diff, named_grads, run_subtests

# (name, chunks): every schedule cadence generates.
SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved", 2),
    ("looped_bfs", 2),
    ("zb_h1", 1),
    ("zb_h1", 2),
    ("zbv", 2),
    ("dualpipev", 2),
]
TOL = 1e-6


def configs(p: int) -> list[tuple[str, int, int, str]]:
    """(name, v, m, source): every schedule at m = p and 2p from cadence's generator;
    at world 2 also torch's own lowered lists of a loop and both V schedules (the
    ones whose same-rank hand-offs `complete_comms` has to add)."""
    out = [(name, v, m, "cadence") for name, v in SCHEDULES for m in (p, 2 * p)]
    # DualPipeV needs m >= 2p (both cadence's generator and torch refuse m = p).
    out = [c for c in out if not (c[0] == "dualpipev" and c[2] < 2 * p)]
    if p == 2:
        out += [(name, 2, 2 * p, "torch") for name in ("interleaved", "zbv", "dualpipev")]
    return out


def _model(stages: int) -> TinyGPT:
    torch.manual_seed(1234)
    return TinyGPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=stages))


def _stage_grads(chunks, mine):
    return {f"{s}.{k}": g for s in mine for k, g in named_grads(chunks[s]).items()}


def _run_torch(name, chunks, mine, n_stages, m, x, y, rank0_first):
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import schedules as ts

    cls = ts.get_schedule_class(torch_schedule_name(name))
    tstages = [TorchStage(chunks[s], s, n_stages, torch.device("cpu")) for s in mine]
    if issubclass(cls, ts.PipelineScheduleSingle):
        sched = cls(tstages[0], n_microbatches=m, loss_fn=TinyGPT.loss)
    else:
        sched = cls(tstages, n_microbatches=m, loss_fn=TinyGPT.loss)
    losses: list = []
    args = (x,) if rank0_first else ()
    sched.step(*args, target=y, losses=losses)
    return [float(v) for v in losses]


def _one_config(config: tuple[str, int, int, str]) -> dict:
    name, v, m, source = config
    rank, p = dist.get_rank(), dist.get_world_size()
    n_stages = p * v
    mine = sorted(s for s, r in placement_for(name, p, v).items() if r == rank)
    x, y = MarkovTokens(32, 8, seed=3).batch(0, 2 * m)
    # reference: one process, the full batch, mean loss
    ref = _model(n_stages)
    ref_chunks = ref.split_stages(n_stages)
    TinyGPT.loss(ref(x), y).backward()
    with torch.no_grad():
        ref_losses = [float(TinyGPT.loss(ref(xi), yi)) for xi, yi in zip(x.chunk(m), y.chunk(m))]
    # cadence
    chunks = _model(n_stages).split_stages(n_stages)
    log = EventLog()
    rt = build_pipeline(
        name,
        chunks,
        n_microbatches=m,
        chunks=v,
        loss_fn=TinyGPT.loss,
        source=source,  # type: ignore[arg-type]
        event_log=log,
    )
    log.clear()  # count one step, not the setup traffic
    losses: list = []
    rt.step(x, target=y, losses=losses)
    p2p = [e for e in log.collectives() if e.kind in ("send", "recv")]
    planned = [a for a in rt.actions if a.kind in (ActionKind.SEND, ActionKind.RECV)]
    c_losses = [float(v) for v in losses]
    c_grads = _stage_grads(chunks, mine)
    row = {
        "grad_vs_ref": max_abs_diff(c_grads, _stage_grads(ref_chunks, mine)),
        "loss_vs_ref": max_abs_diff(c_losses, ref_losses) if c_losses else 0.0,
        "has_losses": bool(c_losses),
        "channels": sorted({e.group for e in p2p}),
        # Per channel, the ops posted are the planned ones in the planned order (receives
        # may be posted ahead of the list, see [Note: receive lookahead], never reordered).
        "op_channel_matches": per_channel(
            (f"pp{a.channel[0]}->{a.channel[1]}", a.kind.name.lower(), a.mb) for a in planned
        )
        == per_channel((e.group, e.kind, None) for e in p2p),
        "recv_timing": recv_timing(rt.actions, log),
        "local_fwd": sum(1 for e in log.marks("pp_local") if not e.meta["grad"]),
        "local_bwd": sum(1 for e in log.marks("pp_local") if e.meta["grad"]),
    }
    if source == "cadence":
        # torch pipelining on the same model and schedule
        tchunks = _model(n_stages).split_stages(n_stages)
        try:
            t_losses = _run_torch(name, tchunks, mine, n_stages, m, x, y, 0 in mine)
        except Exception as e:  # torch refuses some (schedule, m) pairs; say which
            row["torch"] = f"unsupported: {type(e).__name__}: {str(e)[:120]}"
        else:
            row["torch"] = "ran"
            row["grad_vs_torch"] = max_abs_diff(c_grads, _stage_grads(tchunks, mine))
            row["loss_vs_torch"] = max_abs_diff(c_losses, t_losses) if c_losses else 0.0
    dist.barrier()
    return row


def per_channel(ops) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for group, kind, _ in ops:
        out.setdefault(group, []).append(kind)
    return out


def recv_timing(actions, log) -> dict[str, int]:
    """Each RECV's post against its place in the list, counted in computes before it:
    ``early`` receives were posted ahead of the list, ``late`` after it (never)."""
    planned: dict[str, list[int]] = {}
    done = 0
    for a in actions:
        if a.kind is ActionKind.RECV:
            planned.setdefault(f"pp{a.channel[0]}->{a.channel[1]}", []).append(done)
        done += len(a.compute_parts()) if a.is_compute else 0
    posted: dict[str, list[int]] = {}
    done = 0
    for e in log.events:
        if e.kind == "mark" and e.group == "pp_compute":
            done += 1
        elif e.kind == "recv":
            posted.setdefault(e.group, []).append(done)
    pairs = [(x, y) for g in planned for x, y in zip(planned[g], posted.get(g, []), strict=True)]
    return {"early": sum(y < x for x, y in pairs), "late": sum(y > x for x, y in pairs)}


def body_parity(cfgs: list[tuple[str, int, int, str]]) -> dict[str, dict]:
    return run_subtests({"config": cfgs}, _one_config)
