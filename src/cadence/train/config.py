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

Each value is checked on its own first, against a rule derived from its annotation
(`RULES`, `MODEL_RULES`; see [Note: a value is refused where it is given, not where
it breaks] in `cadence.train._rules`), then in combination with the others.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from cadence.models.config import GPTConfig
from cadence.pipeline.schedule._errors import ScheduleValidationError
from cadence.pipeline.schedule.channels import CHANNEL_MODES
from cadence.pipeline.schedule.generators import canonical_name, default_chunks, generate
from cadence.pipeline.schedule.ir import ActionKind
from cadence.train._errors import TrainConfigError
from cadence.train._rules import ValueRule, derive_rules, text_problem

__all__ = [
    "MODEL_RULES",
    "MODEL_SPEC",
    "RULES",
    "Layout",
    "TrainConfig",
    "TrainConfigError",
    "model_from_flags",
    "option_name",
]

Wrapper = Literal["DataParallel", "fully_shard", "none"]
# Used when --bucket-cap-mb is not given: small buckets, so the tiny model gets
# several and its all-reduces overlap backward.
DEFAULT_BUCKET_CAP_MB = 0.25


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
    """AdamW learning rate: the peak of the schedule (see ``lr_schedule``)."""
    warmup_steps: int = 0
    """Raise the learning rate linearly over the first this many optimizer steps, from
    ``lr / warmup_steps`` to ``lr``; 0: no warmup."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After the warmup, ``constant`` keeps ``lr``; ``cosine`` decays it to ``min_lr`` over
    the remaining steps of ``steps`` (see `cadence.train.lr_schedule`)."""
    min_lr: float | None = None
    """Where ``cosine`` ends; None means 0. Only with ``lr_schedule = "cosine"``."""
    clip_grad_norm: float | None = None
    """Scale the gradients so that their global norm (over the whole model, whatever
    the layout) is at most this, before each optimizer step; None: no clipping."""
    peak_flops: float | None = None
    """The peak FLOP/s of one device, for the model FLOPs utilization (MFU) of the
    summary; None: MFU is not reported."""
    sample_tokens: int = 0
    """After the last step, generate this many tokens from the trained model on every
    rank in lockstep, print rank 0's and save them to ``<run_dir>/samples.txt``; 0: none.
    Only with ``pp = 1`` (a pipeline's stages live on different ranks)."""
    sample_temperature: float = 0.0
    """Sampling temperature of ``sample_tokens``; 0 is greedy (the likeliest token)."""
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
    ac: Literal["none", "full", "selective"] = "none"
    """Activation checkpointing of each block (`cadence.train.activation_checkpoint`):
    ``full`` keeps only a block's input and recomputes the block in backward;
    ``selective`` also keeps its matmul and attention outputs."""
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
    """The TinyGPT shape; with ``pp > 1`` it needs at least one block per stage. With
    ``model_factory`` only its ``vocab_size`` and ``seq_len`` are used: the data's ids
    and window length."""
    model_factory: str = ""
    """``--model``: what to train instead of the embedded TinyGPT (""): ``llama`` (the
    embedded `cadence.models.llama.Llama`), ``hf:<ClassName>`` (a ``transformers``
    model built from a config, no weights) or ``package.module:factory`` (any callable
    returning an ``nn.Module``). See `cadence.train.model_factory`."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """``--model-config`` (JSON) or ``[train.model_config]``: the keyword arguments of
    ``model_factory`` (for ``hf:``, of the model's config class). Only with it."""
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
    export: str = ""
    """After the last step, write the trained weights to this folder as one
    ``model.safetensors`` (the unwrapped model's names, whatever the layout), plus
    ``config.json`` for a ``transformers`` model, which ``from_pretrained`` then loads
    without cadence. "" exports nothing."""
    resume: bool = False
    """Continue from the newest complete checkpoint in ``run_dir`` if there is one, else
    start fresh: the same command serves the first launch and every restart. Without
    it (or ``overwrite``), a ``run_dir`` that holds checkpoints is refused."""
    overwrite: bool = False
    """Start over in a ``run_dir`` that holds an earlier run's checkpoints: they are
    deleted before any rank starts (every ``step-<N>`` folder, whatever run wrote it).
    Not with ``resume``."""
    trust_checkpoint: bool = False
    """With ``resume``: the user vouches for ``run_dir``, so the checkpoint's signature
    is not checked (one written by another user or machine, or by a cadence from
    before signatures); its content hashes, where it has them, still are."""
    data: str = ""
    """What to train on: "" the synthetic Markov task; ``stdlib`` the Python standard
    library's source, byte-level; a path: token shards (``.bin``: nanoGPT's flat files
    or llm.c's with a header) or text (a file, or a folder's files), byte-level unless
    ``tokenizer``. See `cadence.train.data`."""
    data_dtype: Literal["", "uint16", "uint32"] = ""
    """The id type of flat token shards; "" reads llm.c's header where a shard has one,
    else uint16. Only with shards."""
    tokenizer: str = ""
    """A ``tokenizers`` JSON file that encodes text ``data``; "" is byte-level (256 ids).
    Needs the tokenizers package."""
    val_fraction: float | None = None
    """The last this fraction of ``data``'s tokens is held out, never trained on; None
    means 0.01. Only with ``data``."""
    eval_every: int = 0
    """Compute the loss on the held-out tokens every this many steps and after the last
    (``metrics.json``, ``loss.png``); 0 never. Only with ``data``."""
    eval_batches: int = 0
    """Batches of ``batch_size`` rows per evaluation; 0 means 4. Only with ``eval_every``."""

    def __post_init__(self) -> None:
        err = TrainConfigError
        for name, rule in RULES.items():
            _check(option_name(name), rule, getattr(self, name))
        problem = text_problem(self.run_dir)
        if problem:
            raise err(f"--run-dir {self.run_dir!r} {problem}")
        problem = text_problem(self.export)
        if problem:
            raise err(f"--export {self.export!r} {problem}")
        self._check_data()
        _check_model(self.model)
        self._check_model_factory()
        if self.mixed_precision != "none" and not self.fsdp:
            raise err("--mixed-precision needs --fsdp (DataParallel keeps fp32 params)")
        if self.ac != "none" and self.compile:
            raise err(
                "--ac with --compile is not offered: with --fsdp precompile compiles each "
                "block's own forward, which --ac replaces, and in a compiled graph what is "
                "recomputed is the compiler's choice, not --ac's; drop one of the two"
            )
        if self.dp_replicate > 1 and not self.fsdp:
            raise err(
                "--dp-replicate (HSDP) needs --fsdp: DataParallel replicates every rank already"
            )
        self._check_checkpointing()
        self._check_optimizer()
        self.layout()  # everything that depends on the world size

    def _check_optimizer(self) -> None:
        err = TrainConfigError
        if self.min_lr is not None:
            if self.lr_schedule != "cosine":
                raise err(
                    "--min-lr is where the cosine schedule ends: add --lr-schedule cosine "
                    "(or drop --min-lr)"
                )
            if self.min_lr > self.lr:
                raise err(
                    f"--min-lr {self.min_lr} is above --lr {self.lr}: the cosine schedule "
                    "decays from --lr down to --min-lr"
                )
        if self.warmup_steps and self.warmup_steps >= self.steps:
            raise err(
                f"--warmup-steps {self.warmup_steps} must be below --steps {self.steps}: the "
                "warmup would not end before the run does"
            )
        if self.sample_temperature and not self.sample_tokens:
            raise err("--sample-temperature sets how --sample-tokens N samples: add it")
        if self.sample_tokens and self.pp > 1:
            raise err(
                "--sample-tokens needs --pp 1: generation runs the whole model on each rank, "
                "and a pipeline's stages live on different ranks"
            )

    def _check_data(self) -> None:
        err = TrainConfigError
        for flag, path in (("--data", self.data), ("--tokenizer", self.tokenizer)):
            problem = text_problem(path)
            if problem:
                raise err(f"{flag} {path!r} {problem}")
        if not self.data:
            unused = [
                flag
                for flag, value in (
                    ("--data-dtype", self.data_dtype),
                    ("--tokenizer", self.tokenizer),
                    ("--val-fraction", self.val_fraction is not None),
                    ("--eval-every", self.eval_every),
                    ("--eval-batches", self.eval_batches),
                )
                if value
            ]
            if unused:
                raise err(
                    f"{', '.join(unused)} need --data (stdlib, token shards or text); the "
                    "Markov task has no held-out tokens and no files"
                )
        if self.eval_batches and not self.eval_every:
            raise err("--eval-batches sets the size of each evaluation: add --eval-every K")
        if self.data_dtype and self.tokenizer:
            raise err(
                "--data-dtype is for token shards and --tokenizer for text: give one of the two"
            )

    def _check_model_factory(self) -> None:
        err = TrainConfigError
        spec, kwargs = self.model_factory, self.model_config
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise err(f"--model-config must be a JSON object (a table), got {kwargs!r}")
        if not spec:
            if kwargs:
                raise err(
                    "--model-config holds the keyword arguments of --model's factory: add "
                    "--model (the embedded TinyGPT takes --d-model, --layers, [train.model])"
                )
            return
        if not MODEL_SPEC.fullmatch(spec):
            raise err(
                f"--model {spec!r} must be llama, hf:<ClassName> (a transformers model) or "
                "package.module:factory (a callable returning an nn.Module)"
            )
        for key, value in kwargs.items():
            problem = _toml_problem(value)
            if problem:
                raise err(f"--model-config {key!r}: {problem}")
        base = GPTConfig()
        shaped = [
            option_name(f.name)
            for f in fields(GPTConfig)
            if f.name not in ("vocab_size", "seq_len")
            and getattr(self.model, f.name) != getattr(base, f.name)
        ]
        if shaped:
            raise err(
                f"{', '.join(shaped)} shape the embedded TinyGPT, not --model {spec}: give "
                "the model's own keyword arguments in --model-config (or [train.model_config])"
            )
        if self.compile and spec != "llama":
            raise err(
                f"--compile precompiles the embedded models' blocks only (TinyGPT, --model "
                f"llama), whose inputs it knows: drop it for --model {spec}"
            )

    def _check_checkpointing(self) -> None:
        err = TrainConfigError
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise err(
                "--tensorboard needs the tensorboard package, which torch.utils.tensorboard "
                "writes through: pip install tensorboard (or drop the flag)"
            )
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
        if self.trust_checkpoint and not self.resume:
            raise err("--trust-checkpoint vouches for the checkpoint --resume loads: add --resume")

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
        try:
            name = canonical_name(self.schedule or "1f1b")
        except ScheduleValidationError as exc:
            raise ScheduleValidationError(f"--schedule {self.schedule!r}: {exc}") from exc
        v = self.chunks or default_chunks(name)
        m = self.microbatches or 2 * self.pp
        if self.batch_size % (dp * m):
            raise TrainConfigError(
                f"--batch-size {self.batch_size} must be a multiple of dp ({dp}) x "
                f"microbatches ({m}) = {dp * m}"
            )
        # A --model's blocks are counted when it is built (cadence.train.model_factory).
        if not self.model_factory and self.model.n_layers < self.pp * v:
            raise TrainConfigError(
                f"--layers {self.model.n_layers} gives fewer blocks than the {self.pp * v} "
                f"pipeline stages (--pp {self.pp} x chunks {v}); use --layers {self.pp * v} "
                "or more"
            )
        # The generator refuses (p, m, v) it cannot schedule, with the rule it breaks.
        # Every schedule takes data-parallel stages, split (I/W) backwards included.
        try:
            schedule = generate(name, self.pp, m, v)
        except ScheduleValidationError as exc:
            raise ScheduleValidationError(
                f"--pp {self.pp} --schedule {name} --microbatches {m} --chunks {v}: {exc}"
            ) from exc
        if self.ac != "none" and any(a.kind is ActionKind.I for r in schedule.ranks for a in r):
            raise TrainConfigError(
                f"--ac with --schedule {name}: its split backward runs a block's backward in "
                "several passes (I, then W), which selective checkpointing refuses and full "
                "checkpointing pays with a recompute per pass; use gpipe, 1f1b, interleaved "
                "or looped_bfs, or drop --ac"
            )
        return Layout(world, self.pp, dp, wrapper, name, m, v, cap)


# -- the rule of each value -------------------------------------------------------

# Fields that no ``cadence train`` flag sets: a config file's ``[train]`` key does.
_FLAGLESS = frozenset({"timeout"})
# The model's fields that have a flag; the others are ``[train.model]`` keys only.
_MODEL_FLAGS = {"d_model": "--d-model", "n_layers": "--layers", "vocab_size": "--vocab-size"}
# Fields whose flag is not their name with dashes.
_RENAMED = {"model_factory": "--model"}
# What --model may name (see TrainConfig.model_factory): an alias, hf:<ClassName>, or
# module:attribute, each a dotted Python name.
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
MODEL_SPEC = re.compile(rf"llama|hf:[A-Za-z_]\w*|{_DOTTED}:{_DOTTED}")

# [Note: the bounds that are not the annotation's]
# An upper bound is set only where a larger value fails inside the ranks: gloo
# refuses a process-group timeout whose count overflows (measured: 8.6e13 s fails,
# 1e9 s works), torch seeds are 64-bit and the data seed of step N is
# ``seed x 1000003 + N``, and torch.multinomial draws from at most 2**24 categories.
# Sizes that merely do not fit in memory depend on the machine and are refused by
# `cadence.train.preflight` instead.
MAX_COLLECTIVE_TIMEOUT_S = 1e7
MAX_SEED = 2**43
MAX_VOCAB = 2**24

RULES: dict[str, ValueRule] = derive_rules(
    TrainConfig,
    nproc=dict(low=1),
    steps=dict(low=1),
    batch_size=dict(low=1),
    lr=dict(low=0),
    warmup_steps=dict(low=0, note="0: no warmup"),
    min_lr=dict(low=0, note="at most --lr; unset means 0"),
    clip_grad_norm=dict(low=0, above=True, note="the largest global gradient norm"),
    peak_flops=dict(low=0, above=True, note="FLOP/s of one device"),
    sample_tokens=dict(low=0, note="0: none"),
    sample_temperature=dict(low=0, note="0 is greedy"),
    seed=dict(
        low=-MAX_SEED,
        high=MAX_SEED,
        note="the data seed of step N is seed x 1000003 + N, and torch seeds are 64-bit",
    ),
    pp=dict(low=1),
    microbatches=dict(low=0, note="0 picks 2 x pp"),
    chunks=dict(low=0, note="0 picks the schedule's default"),
    channel_mode=dict(choices=("", *CHANNEL_MODES)),
    bucket_cap_mb=dict(low=0, above=True, note="MiB"),
    dp_replicate=dict(low=1),
    timeout=dict(low=0, above=True, note="seconds"),
    collective_timeout=dict(
        low=0,
        above=True,
        high=MAX_COLLECTIVE_TIMEOUT_S,
        note="seconds; about 116 days at most, as far longer waits overflow the backends",
    ),
    checkpoint_every=dict(low=0, note="0 saves none"),
    keep=dict(low=0, note="0 keeps all"),
    val_fraction=dict(low=0, above=True, high=0.5, note="of the tokens; unset means 0.01"),
    eval_every=dict(low=0, note="0 never"),
    eval_batches=dict(low=0, note="0 means 4"),
)
"""The rule of each `TrainConfig` field but ``model`` (whose fields have `MODEL_RULES`)."""

MODEL_RULES: dict[str, ValueRule] = derive_rules(
    GPTConfig,
    vocab_size=dict(low=1, high=MAX_VOCAB, note="torch.multinomial draws from at most 2**24"),
    seq_len=dict(low=1),
    d_model=dict(low=1),
    n_heads=dict(low=1),
    n_layers=dict(low=1),
    mlp_ratio=dict(low=1),
)
"""The rule of each `GPTConfig` field (``[train.model]``)."""


def option_name(name: str) -> str:
    """How a refusal names the `TrainConfig` field ``name``: its flag, or for a field
    without one its config-file key."""
    if name in _FLAGLESS:
        return f"[train] {name}"
    if name in _MODEL_FLAGS:
        return _MODEL_FLAGS[name]
    if name in _RENAMED:
        return _RENAMED[name]
    if name in MODEL_RULES:
        return f"[train.model] {name}"
    return "--" + name.replace("_", "-")


def _check(option: str, rule: ValueRule, value: object) -> None:
    if not rule.accepts(value):
        raise TrainConfigError(f"{option} must be {rule.expected()}, got {value!r}")


def _toml_problem(value: object) -> str | None:
    """Why ``value`` (a ``--model-config`` value) cannot be written to config.toml, or
    None: TOML has no null, and its keys and strings are Unicode text."""
    if value is None:
        return "null has no TOML spelling: leave the key out for the default"
    if isinstance(value, (list, tuple)):
        return next(filter(None, map(_toml_problem, value)), None)
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"key {k!r} is not a string"
            problem = text_problem(k) or _toml_problem(v)
            if problem:
                return problem
        return None
    if isinstance(value, float) and value != value:
        return None  # nan is TOML's
    if isinstance(value, str):
        return text_problem(value)
    if isinstance(value, (bool, int, float)):
        return None
    return f"{value!r} is not a JSON or TOML value"


def _check_model(model: object) -> None:
    if not isinstance(model, GPTConfig):
        raise TrainConfigError(f"model must be a GPTConfig (cadence.models.config), got {model!r}")
    for f in fields(GPTConfig):
        _check(option_name(f.name), MODEL_RULES[f.name], getattr(model, f.name))


def model_from_flags(
    base: GPTConfig, d_model: int, n_layers: int, vocab_size: int | None = None
) -> GPTConfig:
    """``base`` with ``--d-model``, ``--layers`` and ``--vocab-size`` (None keeps
    ``base``'s), each refused by its flag's name (`GPTConfig` itself names neither flag
    nor fix)."""
    _check("--d-model", MODEL_RULES["d_model"], d_model)
    _check("--layers", MODEL_RULES["n_layers"], n_layers)
    if vocab_size is not None:
        _check("--vocab-size", MODEL_RULES["vocab_size"], vocab_size)
        base = replace(base, vocab_size=vocab_size)
    heads = base.n_heads
    if d_model % heads:
        raise TrainConfigError(
            f"--d-model {d_model} must be a multiple of the {heads} attention heads "
            f"([train.model] n_heads): use --d-model {d_model + heads - d_model % heads}, "
            "or set n_heads to a divisor of it"
        )
    return replace(base, d_model=d_model, n_layers=n_layers)
