"""Rank bodies of the end-of-run report tests."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from cadence.models.config import GPTConfig
from cadence.train.config import TrainConfig
from cadence.train.run import run_rank

BASE = TrainConfig(steps=3, batch_size=8, model=GPTConfig(d_model=16, n_layers=2))


def body_reports(flags: dict) -> dict[str, Any]:
    """One short run; what this rank returns of the per-rank reports."""
    cfg = dataclasses.replace(BASE, nproc=dist.get_world_size(), **flags)
    out = run_rank(cfg)
    return {k: out[k] for k in ("timeline", "timeline_bounds")}
