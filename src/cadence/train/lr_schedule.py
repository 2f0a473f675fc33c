"""``--warmup-steps``, ``--lr-schedule`` and ``--min-lr``: the learning rate of each step.

[Note: the learning-rate schedule]
The optimizer step ``k`` (0-based) runs at ``lr x factor(k)``:

- warmup, ``k < W``: ``factor = (k + 1) / W``, so the first step runs at ``lr / W``
  and step ``W - 1`` at ``lr``;
- then ``constant``: 1; ``cosine``: from ``lr`` at step ``W`` down to ``min_lr`` at the
  last step, ``min_lr + (lr - min_lr) x (1 + cos(pi x (k - W) / (S - 1 - W))) / 2``
  with ``S`` = ``--steps``.

It is a torch ``LambdaLR``, stepped once per optimizer step, on every layout (a
pipeline rank has one optimizer over its stages and one scheduler for it). Its
``last_epoch`` is the number of steps taken, and a checkpoint saves its state dict
beside the optimizer's, so a resumed run computes each step's rate from the same
``(base_lrs, last_epoch)`` as an unbroken one: ``LambdaLR`` sets the rate from them
alone, never by updating the previous one, so the rates are bit-identical. A cosine
schedule depends on ``--steps``, so a resume under another ``--steps`` is refused
(`cadence.train.checkpoint`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from cadence.train._errors import CheckpointError
from cadence.train.config import TrainConfig

__all__ = [
    "lr_factor",
    "make_scheduler",
    "other_steps_problem",
    "restore_scheduler",
    "scheduler_placeholders",
    "scheduler_state",
]


def lr_factor(cfg: TrainConfig, k: int) -> float:
    """The multiple of ``--lr`` that optimizer step ``k`` (0-based) runs at. See
    [Note: the learning-rate schedule]."""
    w = cfg.warmup_steps
    if k < w:
        return (k + 1) / w
    if cfg.lr_schedule == "constant" or cfg.lr == 0:
        return 1.0
    floor = (cfg.min_lr or 0.0) / cfg.lr
    span = cfg.steps - 1 - w
    # A resumed run may step past --steps only if its --steps grew, which is refused;
    # clamp anyway so the rate never climbs back up the cosine.
    progress = min(1.0, (k - w) / span) if span > 0 else 1.0
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def other_steps_problem(cfg: TrainConfig, saved_steps: int) -> str | None:
    """Why a resume under ``cfg`` cannot continue a checkpoint of a run of
    ``saved_steps`` steps, or None: a cosine schedule decays over ``--steps``."""
    if cfg.lr_schedule != "cosine" or saved_steps == cfg.steps:
        return None
    return (
        f"the checkpoint was written by a run of --steps {saved_steps}, and its cosine "
        f"learning-rate schedule decays over those steps: resume with --steps {saved_steps} "
        "(another --steps would move every step's rate along the curve)"
    )


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> LambdaLR:
    """The scheduler of ``optimizer``; call its ``step()`` after each optimizer step."""
    return LambdaLR(optimizer, lambda k: lr_factor(cfg, k))


# A checkpoint holds a scheduler as tensors (read by the weights-only loader, as every
# cadence item is): ``<key>/last_epoch`` (int64) and ``<key>/base_lrs`` (float64,
# which holds a Python float exactly).
def _names(key: str) -> tuple[str, str]:
    return f"{key}/last_epoch", f"{key}/base_lrs"


def scheduler_state(scheduler: LRScheduler, key: str) -> dict[str, torch.Tensor]:
    """``scheduler``'s state as checkpoint items under ``key``."""
    epoch, lrs = _names(key)
    return {
        epoch: torch.tensor(scheduler.last_epoch, dtype=torch.int64),
        lrs: torch.tensor(scheduler.base_lrs, dtype=torch.float64),
    }


def scheduler_placeholders(metadata: Metadata, key: str, groups: int) -> dict[str, torch.Tensor]:
    """Tensors for `dcp.load` to fill with the scheduler items under ``key``; empty for
    a checkpoint written before schedules were saved (`restore_scheduler` then takes
    the step)."""
    epoch, lrs = _names(key)
    if epoch not in metadata.state_dict_metadata:
        return {}
    return {
        epoch: torch.zeros((), dtype=torch.int64),
        lrs: torch.zeros(groups, dtype=torch.float64),
    }


def restore_scheduler(
    scheduler: LRScheduler,
    optimizer: torch.optim.Optimizer,
    sd: dict[str, Any],
    key: str,
    step: int,
) -> None:
    """Put the loaded items of ``key`` (or, for an older checkpoint without them, the
    checkpoint's ``step``) into ``scheduler``. The optimizer's learning rates are the
    checkpoint's already (its param groups)."""
    epoch_key, lrs_key = _names(key)
    state = scheduler.state_dict()
    if epoch_key in sd:
        epoch = int(sd[epoch_key])
        if epoch != step:
            raise CheckpointError(
                f"the checkpoint's learning-rate schedule is at step {epoch}, its manifest "
                f"at step {step}"
            )
        state["base_lrs"] = [float(x) for x in sd[lrs_key].tolist()]
    state["last_epoch"] = step
    state["_step_count"] = step + 1
    state["_last_lr"] = [group["lr"] for group in optimizer.param_groups]
    scheduler.load_state_dict(state)
