"""Rank bodies of ``cadence train --compile`` (backend aot_eager: no C++ toolchain)."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

import cadence.train.compile as compile_module
from cadence.models.config import GPTConfig
from cadence.train.config import TrainConfig
from cadence.train.run import run_rank

BASE = TrainConfig(steps=3, batch_size=8, model=GPTConfig(d_model=16, n_layers=2))


def body_compile(flags: dict, run_dir: str) -> dict:
    """Eager, then compiled twice in one run folder (the second time from the cache)."""
    compile_module.BACKEND = "aot_eager"
    cfg = dataclasses.replace(BASE, nproc=dist.get_world_size(), run_dir=run_dir, **flags)
    eager = run_rank(cfg)
    first = run_rank(dataclasses.replace(cfg, compile=True))
    again = run_rank(dataclasses.replace(cfg, compile=True))
    return {
        "eager": eager["losses"],
        "compiled": first["losses"],
        "first": first["precompile"],
        "again": again["precompile"],
    }
