"""Rank bodies of the run-option tests: a run with the gradient norms of each step
measured before clipping, and a run's samples and summary figures."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from cadence._groups.dist_init import init
from cadence.models.config import GPTConfig
from cadence.train.build import build_state, topology_for
from cadence.train.config import TrainConfig
from cadence.train.loop import run_loop

# Tiny and quick; four blocks leave one per stage up to four stages. The bound is
# below the norms this model starts with, so every step clips.
BASE = TrainConfig(
    steps=4,
    batch_size=16,
    clip_grad_norm=0.3,
    warmup_steps=1,
    lr_schedule="cosine",
    min_lr=1e-4,
    model=GPTConfig(d_model=16, n_layers=4),
)


def body_clip(flags: dict[str, Any]) -> dict[str, Any]:
    """The layout ``flags`` on the launched world: each step's global gradient norm
    (before clipping), loss and learning rate."""
    cfg = dataclasses.replace(BASE, nproc=dist.get_world_size(), **flags)
    pg = init(topology_for(cfg.layout()))
    state = build_state(cfg, pg)
    clipper = state.clipper
    assert clipper is not None
    norms: list[float] = []
    lrs: list[float] = []

    def recording() -> float:
        norms.append(clipper())
        lrs.append(float(state.optimizer.param_groups[0]["lr"]))
        return norms[-1]

    state.clipper = recording  # type: ignore[assignment]
    result = run_loop(state, cfg.steps, cfg.batch_size)
    return {"norms": norms, "losses": result.losses, "lrs": lrs}


def body_run(flags: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """One ``cadence train`` rank run (the world is the launched one): the samples and
    the figures the summary is computed from."""
    from cadence.train.run import run_rank

    values: dict[str, Any] = {"model": GPTConfig(d_model=16, n_layers=2), **flags}
    cfg = TrainConfig(steps=3, batch_size=8, nproc=dist.get_world_size(), run_dir=run_dir, **values)
    out = run_rank(cfg)
    keys = ("samples", "flop_params", "peak_memory_bytes", "peak_memory_kind")
    return {k: out[k] for k in keys}
