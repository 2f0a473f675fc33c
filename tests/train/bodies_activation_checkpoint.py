"""Rank bodies of the ``--ac`` tests: every mode under one layout, in one launch; a
run interrupted and resumed with ``--ac`` (the same mode or another)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import cadence
import cadence.train.loop as loop_module
from cadence.models.config import GPTConfig
from cadence.testing import run_subtests
from cadence.train.activation_checkpoint import AC_ATTR
from cadence.train.build import build_state, topology_for
from cadence.train.config import TrainConfig
from cadence.train.loop import run_loop
from cadence.train.run import run_rank
from tests.train.bodies_checkpoint import Interrupted, _interrupt_at

# Tiny and quick; four blocks leave one per stage up to four stages (pp 2 x chunks 2).
BASE = TrainConfig(steps=3, batch_size=16, model=GPTConfig(d_model=16, n_layers=4))
MODES = ("none", "full", "selective")


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a fully_shard DTensor's shard, else itself."""
    return (p.to_local() if isinstance(p, DTensor) else p).detach().clone()


def run_ac(cfg: TrainConfig) -> dict[str, Any]:
    """One run on this rank: its losses, its final parameters (this rank's part of the
    model: its shards, or its stages') and the mode of each module it checkpointed."""
    layout = cfg.layout(dist.get_world_size())
    pg = cadence.init(topology_for(layout))
    state = build_state(cfg, pg)
    result = run_loop(state, cfg.steps, cfg.batch_size)
    params = {
        f"{i}.{name}": _local(p)
        for i, root in enumerate(state.modules)
        for name, p in root.named_parameters()
    }
    modules = {m for root in state.modules for m in root.modules()}
    return {
        "losses": result.losses,
        "params": params,
        "checkpointed": sorted(getattr(m, AC_ATTR) for m in modules if hasattr(m, AC_ATTR)),
    }


def body_ac(base: TrainConfig, flag_sets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each flag set over ``base`` with every ``--ac`` mode, in one launch: one
    ``{mode: run_ac result}`` per flag set."""
    world = dist.get_world_size()

    def case(flags: dict[str, Any], ac: str) -> dict[str, Any]:
        return run_ac(dataclasses.replace(base, nproc=world, ac=ac, **flags))

    runs = list(run_subtests({"flags": flag_sets, "ac": list(MODES)}, case).values())
    # run_subtests runs the grid with its last key fastest: the modes of one flag set
    # are consecutive.
    n = len(MODES)
    return [dict(zip(MODES, runs[i * n : (i + 1) * n], strict=True)) for i in range(len(flag_sets))]


def body_resume(flags: dict[str, Any], run_dir: str, before: str, after: str) -> dict[str, Any]:
    """An unbroken run without ``--ac``; the same run with ``--ac before`` and
    checkpoints every 3 steps, lost before step 5 and resumed with ``--ac after``."""
    base = dataclasses.replace(BASE, steps=6, nproc=dist.get_world_size(), **flags)
    full = run_rank(dataclasses.replace(base, run_dir=f"{run_dir}/full"))
    cut = dataclasses.replace(
        base, run_dir=f"{run_dir}/cut", checkpoint_every=3, resume=True, ac=before
    )
    real = _interrupt_at(5)
    try:
        run_rank(cut)
        raise AssertionError("the interruption did not happen")
    except Interrupted:
        pass
    finally:
        loop_module.train_step = real
    dist.barrier()  # every rank is past the interruption before any looks for checkpoints
    resumed = run_rank(dataclasses.replace(cut, ac=after))
    return {"full": full["losses"], "resumed": resumed["losses"], "history": resumed["history"]}
