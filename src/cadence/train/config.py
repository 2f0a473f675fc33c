"""`TrainConfig`: the values of one ``cadence train`` run, and the layout they imply.

Torch-free, so the ``cadence`` parser and a config file can be read and checked
before anything heavy is imported. Every field is a plain value (a TOML table
``[train]`` with these keys, and ``[train.model]`` for `GPTConfig`), documented
under its declaration.

[Note: every flag is honoured or refused]
A flag the loop cannot honour is refused here, with the flag's name and the fix,
before any process starts or any collective runs: a silently ignored flag makes a
run that differs from the one asked for. So flags that only one layout uses have
an "unset" default (``schedule=""``, ``microbatches=0``, ``chunks=0``,
``channel_mode=""``, ``bucket_cap_mb=None``) and are refused when set for another layout, e.g.
``--schedule`` without ``--pp``, ``--bucket-cap-mb`` with ``--fsdp``, or
``--finalize manual`` with ``--pp`` (there the schedule's REDUCE_GRAD and
WAIT_REDUCE_GRAD actions decide when reductions finish).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, replace
from typing import Literal

from cadence.errors import CadenceError
from cadence.models.config import GPTConfig
from cadence.pipeline.schedule.channels import CHANNEL_MODES
from cadence.pipeline.schedule.generators import canonical_name, default_chunks, generate

__all__ = ["Layout", "TrainConfig", "TrainConfigError"]

Wrapper = Literal["DataParallel", "fully_shard", "none"]
# Used when --bucket-cap-mb is not given: small buckets, so the tiny model gets
# several and its all-reduces overlap backward.
DEFAULT_BUCKET_CAP_MB = 0.25


class TrainConfigError(CadenceError, ValueError):
    """A ``cadence train`` flag (or flag combination) the run cannot honour."""


@dataclass(frozen=True)
class Layout:
    """How a `TrainConfig` runs on a world of ``world`` ranks (derived, validated)."""

    world: int
    pp: int
    dp: int
    wrapper: Wrapper
    """What wraps the model (pp=1) or each local stage (pp>1) for data parallelism."""
    schedule: str = ""
    """Canonical generator name; "" when pp == 1."""
    microbatches: int = 1
    chunks: int = 1
    bucket_cap_mb: float | None = None
    """DataParallel's bucket cap; None unless the wrapper is DataParallel."""
    dp_replicate: int = 1
    """fully_shard only: replicas (HSDP) of the ``dp / dp_replicate`` sharded ranks."""

    @property
    def stages(self) -> int:
        return self.pp * self.chunks


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Values of one ``cadence train`` run, validated at construction.

    See [Note: every flag is honoured or refused].
    """

    nproc: int = 2
    """Local ranks to spawn. Under torchrun (RANK and WORLD_SIZE set) the launched
    world is used instead."""
    steps: int = 150
    """Optimizer steps."""
    batch_size: int = 32
    """Global batch per step; each data-parallel replica trains on its equal slice."""
    lr: float = 3e-3
    """AdamW learning rate."""
    seed: int = 0
    """Model initialisation and data seed (the same on every rank)."""
    finalize: Literal["auto", "manual"] = "auto"
    """pp=1: ``auto`` finishes gradient reductions at the end of backward; ``manual``
    keeps them in flight while the loss is averaged, and waits before the optimizer."""
    fsdp: bool = False
    """Wrap with ``cadence.fully_shard`` (sharded over the data-parallel ranks) instead
    of ``cadence.DataParallel``; with ``pp > 1`` each local stage is wrapped."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """``bf16`` computes in bfloat16 with fp32 reductions; needs ``fsdp``."""
    pp: int = 1
    """Pipeline ranks; the world is ``pp x dp``."""
    schedule: str = ""
    """Pipeline schedule (gpipe, 1f1b, interleaved, looped_bfs, zb_h1, zbv, dualpipev);
    "" means 1f1b. Only with ``pp > 1``."""
    microbatches: int = 0
    """Microbatches per step; 0 means ``2 x pp``. Only with ``pp > 1``."""
    chunks: int = 0
    """Stages per pipeline rank; 0 means the schedule's default. Only with ``pp > 1``."""
    channel_mode: str = ""
    """The pipeline's P2P communicators: per_directed_edge, per_direction (two per
    pipeline, for NCCL users who cap communicators) or shared; "" means
    per_directed_edge. Only with ``pp > 1``."""
    model: GPTConfig = field(default_factory=GPTConfig)
    """The TinyGPT shape; with ``pp > 1`` it needs at least one block per stage."""
    bucket_cap_mb: float | None = None
    """DataParallel's bucket size in MiB; None means 0.25. Only with DataParallel."""
    dp_replicate: int = 1
    """HSDP: with ``fsdp``, the data-parallel ranks form ``dp_replicate`` replicas, each
    sharding over ``dp / dp_replicate`` ranks (gradients reduce-scattered in a replica,
    then all-reduced across replicas). 1: plain fully_shard over all dp ranks."""
    run_dir: str = ""
    """Where ``metrics.json``, the plots and the checkpoints go; "" means
    ``runs/<timestamp>`` (refused with checkpoints: every rank and every restart must
    name the same folder)."""
    timeout: float = 1800.0
    """Seconds before a hung local launch is stopped."""
    collective_timeout: float = 600.0
    """Seconds a collective may wait for its peers before the rank stops with an error
    naming itself, the step and the collective (a peer that stopped answering)."""
    checkpoint_every: int = 0
    """Save a checkpoint to ``<run_dir>/checkpoints/step-<N>/`` every this many steps
    (and after the last step); 0 saves none."""
    keep: int = 0
    """Keep only the newest this many checkpoints; 0 keeps all."""
    async_checkpoint: bool = False
    """Write checkpoints in the background (DCP's ``async_save``): the step waits only
    for the copy of the state, not for the disk."""
    compile: bool = False
    """Precompile the forward of the wrapped model (or of each local pipeline stage;
    with ``fsdp``, of each block) with `cadence.precompile_module`: one compile per
    data-parallel group, cached in ``<run_dir>/precompile``."""
    tensorboard: bool = False
    """Rank 0 also writes the loss to TensorBoard event files in ``<run_dir>/tensorboard``
    (needs the ``tensorboard`` package)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in ``run_dir`` if there is one, else
    start fresh: the same command serves the first launch and every restart. Without
    it (or ``overwrite``), a ``run_dir`` that holds checkpoints is refused."""
    overwrite: bool = False
    """Start over in a ``run_dir`` that holds an earlier run's checkpoints: they are
    deleted before any rank starts (every ``step-<N>`` folder, whatever run wrote it).
    Not with ``resume``."""

    def __post_init__(self) -> None:
        err = TrainConfigError
        if self.finalize not in ("auto", "manual"):
            raise err(f"--finalize must be auto or manual, got {self.finalize!r}")
        if self.mixed_precision not in ("none", "bf16"):
            raise err(f"--mixed-precision must be none or bf16, got {self.mixed_precision!r}")
        if self.mixed_precision != "none" and not self.fsdp:
            raise err("--mixed-precision needs --fsdp (DataParallel keeps fp32 params)")
        if self.nproc < 1 or self.steps < 1 or self.batch_size < 1:
            raise err("--nproc, --steps and --batch-size must be >= 1")
        if self.pp < 1:
            raise err("--pp must be >= 1")
        if self.microbatches < 0 or self.chunks < 0:
            raise err("--microbatches and --chunks must be >= 0 (0 picks the default)")
        if self.dp_replicate < 1:
            raise err(f"--dp-replicate must be >= 1, got {self.dp_replicate}")
        if self.dp_replicate > 1 and not self.fsdp:
            raise err(
                "--dp-replicate (HSDP) needs --fsdp: DataParallel replicates every rank already"
            )
        if self.channel_mode and self.channel_mode not in CHANNEL_MODES:
            raise err(
                f"--channel-mode must be one of {', '.join(CHANNEL_MODES)}, "
                f"got {self.channel_mode!r}"
            )
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            raise err(f"--bucket-cap-mb must be > 0, got {self.bucket_cap_mb}")
        self._check_checkpointing()
        self.layout()  # everything that depends on the world size

    def _check_checkpointing(self) -> None:
        err = TrainConfigError
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise err(
                "--tensorboard needs the tensorboard package, which torch.utils.tensorboard "
                "writes through: pip install tensorboard (or drop the flag)"
            )
        if self.collective_timeout <= 0:
            raise err(f"--collective-timeout must be > 0 seconds, got {self.collective_timeout}")
        if self.checkpoint_every < 0 or self.keep < 0:
            raise err("--checkpoint-every and --keep must be >= 0 (0: never / keep all)")
        if not self.checkpoint_every:
            unused = [
                flag
                for flag, value in (
                    ("--keep", self.keep),
                    ("--async-checkpoint", self.async_checkpoint),
                )
                if value
            ]
            if unused:
                raise err(f"{', '.join(unused)} need --checkpoint-every K (K > 0)")
        if (self.checkpoint_every or self.resume) and not self.run_dir:
            flag = "--resume" if self.resume else "--checkpoint-every"
            raise err(
                f"{flag} needs --run-dir: every rank, and every restart of the job, must "
                "name the same folder"
            )
        if self.overwrite and not self.run_dir:
            # The default runs/<timestamp> is a new folder: nothing to overwrite.
            raise err("--overwrite needs --run-dir (the folder whose checkpoints it deletes)")
        if self.overwrite and self.resume:
            raise err(
                "--resume continues the checkpoints in --run-dir and --overwrite deletes them: "
                "give one of the two"
            )

    @property
    def world_size(self) -> int:
        """The launched world under torchrun, else ``nproc``."""
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return int(os.environ["WORLD_SIZE"])
        return self.nproc

    def layout(self, world: int | None = None) -> Layout:
        """Resolve the defaults for a world of ``world`` ranks (default `world_size`)
        and refuse what that world cannot run. Raises `TrainConfigError`."""
        world = self.world_size if world is None else world
        if world % self.pp:
            raise TrainConfigError(f"--pp {self.pp} must divide the world size {world}")
        dp = world // self.pp
        if self.fsdp:
            wrapper: Wrapper = "fully_shard"
        elif self.pp == 1 or dp > 1:
            wrapper = "DataParallel"
        else:
            wrapper = "none"  # pp ranks only: nothing to reduce across replicas
        if self.bucket_cap_mb is not None and wrapper != "DataParallel":
            raise TrainConfigError(
                f"--bucket-cap-mb sets DataParallel's buckets, but this run wraps with "
                f"{wrapper}; drop the flag"
            )
        if dp % self.dp_replicate:
            raise TrainConfigError(
                f"--dp-replicate {self.dp_replicate} must divide the {dp} data-parallel ranks"
            )
        cap = (self.bucket_cap_mb or DEFAULT_BUCKET_CAP_MB) if wrapper == "DataParallel" else None
        if self.pp == 1:
            layout = self._data_parallel_layout(world, wrapper, cap)
        else:
            layout = self._pipeline_layout(world, dp, wrapper, cap)
        return replace(layout, dp_replicate=self.dp_replicate)

    def _data_parallel_layout(self, world: int, wrapper: Wrapper, cap: float | None) -> Layout:
        unused = [
            flag
            for flag, value in (
                ("--schedule", self.schedule),
                ("--microbatches", self.microbatches),
                ("--chunks", self.chunks),
                ("--channel-mode", self.channel_mode),
            )
            if value
        ]
        if unused:
            raise TrainConfigError(f"{', '.join(unused)} need --pp > 1 (a pipeline)")
        if self.batch_size % world:
            raise TrainConfigError(
                f"--batch-size {self.batch_size} must be divisible by the {world} ranks"
            )
        return Layout(world, 1, world, wrapper, bucket_cap_mb=cap)

    def _pipeline_layout(self, world: int, dp: int, wrapper: Wrapper, cap: float | None) -> Layout:
        if self.finalize != "auto":
            raise TrainConfigError(
                "--finalize manual needs --pp 1: in a pipeline the schedule's REDUCE_GRAD "
                "and WAIT_REDUCE_GRAD actions decide when each stage's reduction finishes"
            )
        name = canonical_name(self.schedule or "1f1b")
        v = self.chunks or default_chunks(name)
        m = self.microbatches or 2 * self.pp
        if self.batch_size % (dp * m):
            raise TrainConfigError(
                f"--batch-size {self.batch_size} must be a multiple of dp ({dp}) x "
                f"microbatches ({m}) = {dp * m}"
            )
        if self.model.n_layers < self.pp * v:
            raise TrainConfigError(
                f"--layers {self.model.n_layers} gives fewer blocks than the {self.pp * v} "
                f"pipeline stages (--pp {self.pp} x chunks {v}); use --layers {self.pp * v} "
                "or more"
            )
        # The generator refuses (p, m, v) it cannot schedule, with the rule it breaks.
        # Every schedule takes data-parallel stages, split (I/W) backwards included.
        generate(name, self.pp, m, v)
        return Layout(world, self.pp, dp, wrapper, name, m, v, cap)
