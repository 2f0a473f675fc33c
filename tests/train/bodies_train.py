"""Rank bodies of the trainer tests: the one loop under several layouts."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

import cadence
from cadence.models.config import GPTConfig
from cadence.testing import run_subtests
from cadence.train.build import build_state, topology_for
from cadence.train.config import TrainConfig
from cadence.train.loop import run_loop

# Small and quick; n_layers 4 leaves a block per stage up to 4 stages.
BASE = TrainConfig(steps=3, batch_size=16, model=GPTConfig(d_model=32, n_layers=4))


def run(cfg: TrainConfig) -> dict:
    """One layout's run on this rank: its losses, and what wraps what."""
    layout = cfg.layout(dist.get_world_size())
    pg = cadence.init(topology_for(layout))
    state = build_state(cfg, pg)
    result = run_loop(state, cfg.steps, cfg.batch_size)
    wrapped = [type(m).__name__ for m in state.modules]
    return {
        "losses": result.losses,
        "wrapper": layout.wrapper,
        "modules": wrapped,
        "step": state.step,
        "collectives": state.event_log.counts(),
        # fully_shard units on this rank (each block and each stage / the model)
        "channel_mode": state.runtime.plan.mode if state.runtime is not None else "",
        "units": sum(len(m._units(recurse=True)) for m in state.modules if hasattr(m, "_units")),
    }


def body_layouts(flag_sets: list[dict]) -> dict:
    """Every flag set in one launch; ``nproc`` follows the launched world."""
    world = dist.get_world_size()

    def case(flags: dict) -> dict:
        return run(dataclasses.replace(BASE, nproc=world, **flags))

    return run_subtests({"flags": flag_sets}, case)
