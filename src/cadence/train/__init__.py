"""``cadence train``: train the embedded TinyGPT with any mix of DP, FSDP and PP.

Modules, one concern each (each importing only those before it):

- ``config``: `TrainConfig` (validated, torch-free) and the `Layout` it implies.
- ``activation_checkpoint``: ``--ac`` (each declared block's forward checkpointed).
- ``build``: the model, its data-parallel wrapper, the pipeline, the optimizer,
  gathered in a `TrainState`.
- ``loop``: `train_step` (one optimizer step, any layout) and `run_loop`.
- ``history``: `RunHistory`, the losses and events carried across restarts.
- ``checkpoint``: DCP checkpoints (atomic commit, ``--keep``, async) and resume.
- ``compile``: ``--compile`` (precompile the wrapped forward).
- ``config_file``, ``plots``: ``--config`` TOML in and out; ``loss.png``, ``timeline.png``.
- ``report``: progress, summary table, ``metrics.json``, ``config.toml``.
- ``run``: `run_rank` (one rank's run) and `train` (launch, run, report).

Names are imported on first use, so reading `TrainConfig` does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence._util.lazy import lazy_getattr

_LAZY = {
    "CheckpointError": "cadence.train.checkpoint:CheckpointError",
    "Checkpointer": "cadence.train.checkpoint:Checkpointer",
    "CollectiveTimeoutError": "cadence.train.loop:CollectiveTimeoutError",
    "ResumeRefusedError": "cadence.train.checkpoint:ResumeRefusedError",
    "RunHistory": "cadence.train.history:RunHistory",
    "find_latest": "cadence.train.checkpoint:find_latest",
    "load_checkpoint": "cadence.train.checkpoint:load_checkpoint",
    "Layout": "cadence.train.config:Layout",
    "TrainConfig": "cadence.train.config:TrainConfig",
    "TrainConfigError": "cadence.train.config:TrainConfigError",
    "TrainState": "cadence.train.build:TrainState",
    "build_state": "cadence.train.build:build_state",
    "run_loop": "cadence.train.loop:run_loop",
    "train_step": "cadence.train.loop:train_step",
    "run_rank": "cadence.train.run:run_rank",
    "train": "cadence.train.run:train",
}
__getattr__ = lazy_getattr("cadence.train", _LAZY, globals())

if TYPE_CHECKING:  # static tools see the eager imports
    from cadence.train._errors import CollectiveTimeoutError, TrainConfigError
    from cadence.train.build import TrainState, build_state
    from cadence.train.checkpoint import (
        Checkpointer,
        CheckpointError,
        ResumeRefusedError,
        find_latest,
        load_checkpoint,
    )
    from cadence.train.config import Layout, TrainConfig
    from cadence.train.history import RunHistory
    from cadence.train.loop import run_loop, train_step
    from cadence.train.run import run_rank, train

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CollectiveTimeoutError",
    "Layout",
    "ResumeRefusedError",
    "RunHistory",
    "TrainConfig",
    "TrainConfigError",
    "TrainState",
    "build_state",
    "find_latest",
    "load_checkpoint",
    "run_loop",
    "run_rank",
    "train",
    "train_step",
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
