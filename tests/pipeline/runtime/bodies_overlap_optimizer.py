"""Rank bodies of the overlapped-optimizer pipeline test: pp=2 x dp=2 at world 4."""

from __future__ import annotations

import torch

import cadence
from cadence.fsdp import fully_shard
from cadence.models import GPTConfig, MarkovTokens, TinyGPT
from cadence.pipeline.runtime import build_pipeline
from cadence.pipeline.schedule import placement_for
from cadence.testing import run_subtests

M = 4  # microbatches
STEPS = 2


def _stages(pg, wrapper: str, name: str, v: int) -> dict[int, torch.nn.Module]:
    """This rank's stages of one TinyGPT, each wrapped; the same weights every call."""
    n = 2 * v
    torch.manual_seed(7)
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=n)
    chunks = TinyGPT(cfg).split_stages(n)
    mine = [s for s, r in placement_for(name, 2, v).items() if r == pg.pp_rank]
    if wrapper == "data_parallel":
        # A small cap: several buckets per stage, so stepping bucket by bucket is exercised.
        return {s: cadence.DataParallel(chunks[s], group=pg, bucket_cap_mb=0.002) for s in mine}
    return {s: fully_shard(chunks[s], group=pg) for s in mine}


def _full(p: torch.Tensor) -> torch.Tensor:
    full = p.full_tensor() if hasattr(p, "full_tensor") else p
    return full.detach().clone()


def overlap_case(pg, wrapper: str, schedule: tuple[str, int]) -> dict:
    """The same pipeline stepped twice two ways: each stage's AdamW overlapped on its
    wrapper (stepped at the stage's reduction wait, inside ``rt.step``), and the plain
    loop (``opt.step()`` after ``rt.step``). Records whether the overlapped parameters
    had all changed before ``opt.step()``, and the largest bitwise difference."""
    name, v = schedule
    data = MarkovTokens(32, 8, seed=11)
    batches = [data.batch(i, 4 * M) for i in range(STEPS)]
    rows = pg.local_slice(batches[0][0].shape[0])
    out: dict[str, dict] = {}
    for mode in ("overlap", "plain"):
        stages = _stages(pg, wrapper, name, v)
        opts = {s: torch.optim.AdamW(m.parameters(), lr=1e-2) for s, m in stages.items()}
        if mode == "overlap":
            for s, m in stages.items():
                m.overlap_optimizer(opts[s])
        rt = build_pipeline(
            name, stages, n_microbatches=M, chunks=v, groups=pg, loss_fn=TinyGPT.loss
        )
        stepped_in_runtime = []
        losses: list[torch.Tensor] = []
        for x, y in batches:
            before = [_full(p) for m in stages.values() for p in m.parameters()]
            rt.step(x[rows], target=y[rows], losses=losses)
            after = [_full(p) for m in stages.values() for p in m.parameters()]
            stepped_in_runtime.append(all(not torch.equal(a, b) for a, b in zip(before, after)))
            for opt in opts.values():
                opt.step()
                opt.zero_grad(set_to_none=True)
        out[mode] = {
            "params": [_full(p) for m in stages.values() for p in m.parameters()],
            # By parameter: stepping in parts creates the state in bucket order.
            "state": [
                _full(t)
                for s, opt in opts.items()
                for p in stages[s].parameters()
                for t in opt.state[p].values()
                if isinstance(t, torch.Tensor)
            ],
            "losses": [float(t) for t in losses],
            "stepped_in_runtime": stepped_in_runtime,
        }
    a, b = out["overlap"], out["plain"]
    return {
        "n_params": len(a["params"]),
        "params_equal": all(
            torch.equal(p, q) for p, q in zip(a["params"], b["params"], strict=True)
        ),
        "state_equal": all(torch.equal(p, q) for p, q in zip(a["state"], b["state"], strict=True)),
        "losses_equal": a["losses"] == b["losses"],
        "overlap_stepped_in_runtime": a["stepped_in_runtime"],
        "plain_stepped_in_runtime": b["stepped_in_runtime"],
    }


def body(grid: dict) -> dict:
    pg = cadence.init(cadence.Topology(dp_shard=2, pp=2))
    return run_subtests(grid, overlap_case, pg)
