"""Rank bodies of the checkpoint tests: interrupt a run, resume it, compare the curves."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import cadence.train.loop as loop_module
import cadence.train.run as run_module
from cadence.models.config import GPTConfig
from cadence.train.checkpoint import Checkpointer
from cadence.train.config import TrainConfig
from cadence.train.run import run_rank

# Tiny and quick; four blocks leave one per stage up to four stages.
BASE = TrainConfig(steps=8, batch_size=16, model=GPTConfig(d_model=16, n_layers=4))


class Interrupted(Exception):
    """Stands for a lost job: raised on every rank before the same step."""


def _interrupt_at(step: int):
    """Patch the loop so that step ``step`` (1-based) raises on every rank."""
    real = loop_module.train_step

    def patched(state, x, y, reduce_loss):
        if state.step + 1 == step:
            raise Interrupted(f"interrupted before step {step}")
        return real(state, x, y, reduce_loss)

    loop_module.train_step = patched
    return real


def body_resume(
    flags: dict, run_dir: str, every: int, stop_at: int, saving: dict | None = None
) -> dict:
    """An uninterrupted run, then a run (with ``saving`` flags too) lost before step
    ``stop_at`` and resumed."""
    world = dist.get_world_size()
    base = dataclasses.replace(BASE, nproc=world, **flags)
    full = run_rank(dataclasses.replace(base, run_dir=f"{run_dir}/full"))
    cut = dataclasses.replace(
        base, run_dir=f"{run_dir}/cut", checkpoint_every=every, resume=True, **(saving or {})
    )
    real = _interrupt_at(stop_at)
    savers: list[Checkpointer] = []

    def recording(*args: Any, **kwargs: Any) -> Checkpointer:
        savers.append(Checkpointer(*args, **kwargs))
        return savers[-1]

    run_module.Checkpointer = recording
    try:
        run_rank(cut)
        raise AssertionError("the interruption did not happen")
    except Interrupted:
        pass
    finally:
        loop_module.train_step = real
        run_module.Checkpointer = Checkpointer
    # A lost process's background save dies with it; here the interrupted run's lives
    # on in this process. Let it finish before the restart looks for checkpoints, else
    # its commit can land after the restart chose a fresh start (a fresh lineage, whose
    # first save would then meet the lost run's complete one).
    for saver in savers:
        saver.wait()
    dist.barrier()
    steps_on_disk = sorted(p.name for p in Path(cut.run_dir, "checkpoints").iterdir())
    resumed = run_rank(cut)
    # The RNG a step after the run would draw: equal when the streams were restored.
    return {
        "full": full["losses"],
        "full_history": full["history"],
        "resumed": resumed["losses"],
        "history": resumed["history"],
        "on_disk": steps_on_disk,
        "draw": torch.rand(1).item(),
    }


def body_train(flags: dict, run_dir: str) -> dict:
    """One ``cadence train`` rank run with ``flags`` (the world is the launched one)."""
    cfg = dataclasses.replace(BASE, nproc=dist.get_world_size(), run_dir=run_dir, **flags)
    out = run_rank(cfg)
    return {"losses": out["losses"], "history": out["history"]}


def body_rng_round_trip(run_dir: str) -> dict:
    """Save at step 2, scramble every RNG, resume: the streams continue where they were."""
    import random

    cfg = dataclasses.replace(
        BASE, nproc=dist.get_world_size(), steps=2, checkpoint_every=2, run_dir=run_dir
    )
    real = loop_module.train_step
    saved: dict = {}

    def remember(state, x, y, reduce_loss):
        if state.step == 0:  # move each rank's streams on, each by its own amount
            torch.rand(5 + dist.get_rank())
            random.seed(100 + dist.get_rank())
        loss = real(state, x, y, reduce_loss)
        if state.step == 2:  # what the checkpoint after step 2 holds
            saved["torch"] = torch.get_rng_state()
            saved["python"] = random.getstate()
        return loss

    loop_module.train_step = remember
    try:
        run_rank(cfg)
    finally:
        loop_module.train_step = real
    expected = (torch.rand(3, generator=torch.Generator().set_state(saved["torch"])).tolist(),)
    random.setstate(saved["python"])
    expected_py = random.random()
    torch.manual_seed(7)
    random.seed(7)
    run_rank(dataclasses.replace(cfg, resume=True))  # nothing left to train: restores only
    # run_rank built a model (drawing from the seeded stream) before loading: the
    # restored state must replace what that left.
    return {
        "same_torch": torch.rand(3).tolist() == expected[0],
        "same_python": random.random() == expected_py,
        "draw": torch.rand(1).item(),
    }


def body_faulty(cfg: TrainConfig, fault: str, at: int, rank: int) -> dict:
    """``run_rank(cfg)`` where ``rank`` dies (``fault="kill"``, SIGKILL) or stops
    answering (``fault="stall"``) just before step ``at``."""
    import os
    import signal
    import time

    real = loop_module.train_step

    def train_step(state, x, y, reduce_loss):
        if state.step + 1 == at and state.groups.rank == rank:
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(300)  # stopped answering; the launcher ends it
        return real(state, x, y, reduce_loss)

    loop_module.train_step = train_step
    out = run_rank(cfg)
    return {"losses": out["losses"], "history": out["history"]}
