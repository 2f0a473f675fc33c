"""Build what a run trains: the model, its data-parallel wrapper, and the pipeline.

One composition for every layout (see `Layout`):

The model is the embedded TinyGPT, or ``--model``'s (`cadence.train.model_factory`),
whose blocks (the fully_shard units, and what ``--ac`` checkpoints:
`cadence.train.activation_checkpoint`) and stage cuts come from the block protocol
(`cadence.models.protocol`).

- ``pp == 1``: the whole model, wrapped with ``DataParallel`` (default) or
  ``fully_shard`` (``--fsdp``: each block, then the root).
- ``pp > 1``: the model cut into ``pp x chunks`` stages; this rank keeps the stages
  the schedule places on its pipeline position and wraps each the same way when
  there are data-parallel replicas (or with ``--fsdp``), then `build_pipeline`
  builds the runtime, which drives the wrappers through their public timing
  verbs only (and, for fully_shard stages, gathers each stage once per step: see
  [Note: sharded pipeline stages are gathered once per step]).

Every rank builds the same model from the same seed, so replicas start equal and
a pipeline's stages are cut from one model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from cadence.comm import EventLog
from cadence.data_parallel import DataParallel
from cadence.fsdp import MixedPrecisionPolicy, fully_shard
from cadence.models.data import MarkovTokens
from cadence.models.gpt import TinyGPT
from cadence.models.protocol import model_blocks, split_model
from cadence.pipeline.runtime.build import build_pipeline
from cadence.pipeline.runtime.executor import PipelineRuntime
from cadence.pipeline.schedule.generators import placement_for
from cadence.topology import ParallelGroups, Topology
from cadence.train.activation_checkpoint import checkpoint_blocks
from cadence.train.clip import GradClipper
from cadence.train.config import Layout, TrainConfig
from cadence.train.data.corpus import corpus_of
from cadence.train.data.windows import TokenWindows
from cadence.train.export import ExportPlan
from cadence.train.lr_schedule import make_scheduler
from cadence.train.model_factory import build_model

__all__ = [
    "EVENT_LOG_CAPACITY",
    "UNSHARD_LOOKAHEAD",
    "TrainState",
    "build_state",
    "make_data",
    "topology_for",
]

# [Note: sharded pipeline stages are gathered once per step]
# With fully_shard stages the schedule places each stage's all-gather (UNSHARD, one
# compute action ahead of the stage's first compute on its rank) and its reshard
# (after its last backward and reduction): one all-gather per unit per step instead
# of one per forward and per backward of every microbatch (pp 2 x dp 2, m = 4, two
# blocks per stage: 1F1B 20 -> 3 per rank, ZBV 40 and 32 -> 6), with bitwise-equal
# gradients. The price is memory: a stage's parameters stay gathered from its first
# to its last compute of the step, as with FSDP2's reshard_after_forward=False,
# which torch pipelining users pick for the same reason.
UNSHARD_LOOKAHEAD = 1
# Events a run's log keeps: timeline.png shows the last 3 steps (at most 512
# communication events of each rank), which this holds whole for steps of up to
# about 2,700 collectives and marks; whole-run figures come from the log's totals.
EVENT_LOG_CAPACITY = 8192


@dataclass
class TrainState:
    """Everything a run holds between steps (what a checkpoint would save).

    Attributes:
        layout: the resolved layout of the run.
        groups: this rank's process groups.
        model: pp=1: the wrapped model that a step calls; pp>1: ``None``.
        runtime: pp>1: this rank's pipeline runtime; pp=1: ``None``.
        modules: what the optimizer updates: ``[model]`` or this rank's stage modules.
        optimizer: AdamW over ``modules``' parameters.
        data: the token stream (the Markov task, or ``--data``'s windows); step ``i``
            reads its global batch ``i``.
        step: the next step to run, which is also the data position.
        event_log: every collective of the data-parallel wrappers.
        lineage: the run's lineage id, recorded in each checkpoint's manifest: a resume
            carries on the loaded one, a fresh run draws one in its `Checkpointer`
            (see [Note: a run's lineage] in `cadence.train.checkpoint`).
        scheduler: the optimizer's learning-rate schedule, stepped after each optimizer
            step (see [Note: the learning-rate schedule] in `cadence.train.lr_schedule`).
        clipper: ``--clip-grad-norm``'s clipping, called before each optimizer step;
            None without the flag.
    """

    layout: Layout
    groups: ParallelGroups
    model: nn.Module | None
    runtime: PipelineRuntime | None
    modules: list[nn.Module]
    optimizer: torch.optim.Optimizer
    data: MarkovTokens | TokenWindows
    step: int = 0
    event_log: EventLog = field(default_factory=EventLog)
    lineage: str | None = None
    scheduler: LRScheduler | None = None
    clipper: GradClipper | None = None
    export_plan: ExportPlan | None = None  # with --export (see cadence.train.export)


def topology_for(layout: Layout) -> Topology:
    """Pipeline outermost; data-parallel ranks shard with fully_shard (in
    ``dp_replicate`` replicas: HSDP), else replicate."""
    if layout.wrapper == "fully_shard":
        r = layout.dp_replicate
        return Topology(dp_replicate=r, dp_shard=layout.dp // r, pp=layout.pp)
    return Topology(dp_replicate=layout.dp, pp=layout.pp)


def _wrap(
    module: nn.Module,
    cfg: TrainConfig,
    layout: Layout,
    pg: ParallelGroups,
    log: EventLog,
    blocks: frozenset[int] = frozenset(),
) -> nn.Module:
    if layout.wrapper == "DataParallel":
        assert layout.bucket_cap_mb is not None  # Layout sets it for DataParallel
        return DataParallel(module, group=pg, bucket_cap_mb=layout.bucket_cap_mb, event_log=log)
    if layout.wrapper == "fully_shard":
        mp = None
        if cfg.mixed_precision == "bf16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # Blocks first, then the rest: a unit per block lets the all-gather of the
        # next block overlap the compute of this one.
        # ``blocks``: the ids of the model's declared blocks (cadence.models.protocol).
        for block in [m for m in module.modules() if id(m) in blocks]:
            fully_shard(block, group=pg, mp_policy=mp, event_log=log)
        return fully_shard(module, group=pg, mp_policy=mp, event_log=log)
    return module


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """TinyGPT's cross-entropy, in fp32 whatever the compute dtype. ``logits`` may be
    a model output object whose ``.logits`` is the tensor (a ``transformers`` model's)."""
    logits = getattr(logits, "logits", logits)
    return TinyGPT.loss(logits.float(), target)


def make_data(cfg: TrainConfig) -> MarkovTokens | TokenWindows:
    """The Markov task, or ``--data``'s windows. Every rank reads the corpus itself
    (memory maps: the pages are shared through the page cache); its checks ran before
    the launch (`cadence.train.preflight`)."""
    if not cfg.data:
        return MarkovTokens(cfg.model.vocab_size, cfg.model.seq_len, seed=cfg.seed)
    return TokenWindows(corpus_of(cfg), cfg.model.seq_len, seed=cfg.seed)


def build_state(cfg: TrainConfig, pg: ParallelGroups) -> TrainState:
    """Build the model (or this rank's stages), wrappers, pipeline and optimizer."""
    layout = cfg.layout(pg.world_size)
    # Bounded: a run steps for as long as it runs (see [Note: a long run's log stays
    # bounded] in cadence/_groups/event_log.py); the timeline needs only the last few steps.
    log = EventLog(capacity=EVENT_LOG_CAPACITY)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)  # same init on every rank
    # Before any wrapper or split: it names what the unwrapped model holds.
    export_plan = ExportPlan.of(model) if cfg.export else None
    blocks = frozenset(map(id, model_blocks(model) or ()))
    if cfg.ac != "none":
        # Before any wrapper: its hooks then run around each checkpointed forward
        # (see [Note: checkpointing patches the block's forward]).
        checkpoint_blocks(model, cfg.ac)
    data = make_data(cfg)
    if layout.pp == 1:
        wrapped = _wrap(model, cfg, layout, pg, log, blocks)  # pp=1 always has a wrapper
        wrapped.set_manual_backward_finalization(cfg.finalize == "manual")  # type: ignore[operator]  # _wrap gives a DataParallel or fully_shard module
        opt = torch.optim.AdamW(wrapped.parameters(), lr=cfg.lr)
        state = TrainState(
            layout, pg, wrapped, None, [wrapped], opt, data, event_log=log, export_plan=export_plan
        )
        return _with_update_rules(state, cfg)
    chunks = split_model(model, layout.stages)
    placement = placement_for(layout.schedule, layout.pp, layout.chunks)
    stages = {
        s: _wrap(chunks[s], cfg, layout, pg, log, blocks)
        for s, r in placement.items()
        if r == pg.pp_rank
    }
    runtime = build_pipeline(
        layout.schedule,
        stages,
        n_microbatches=layout.microbatches,
        chunks=layout.chunks,
        groups=pg,
        loss_fn=loss_fn,
        channel_mode=cfg.channel_mode or "per_directed_edge",  # type: ignore[arg-type]  # a str here; the runtime checks it
        unshard_lookahead=UNSHARD_LOOKAHEAD if layout.wrapper == "fully_shard" else None,
    )
    modules = [runtime.stages[s].module for s in sorted(runtime.stages)]
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    state = TrainState(
        layout, pg, None, runtime, modules, opt, data, event_log=log, export_plan=export_plan
    )
    return _with_update_rules(state, cfg)


def _with_update_rules(state: TrainState, cfg: TrainConfig) -> TrainState:
    """``state`` with its learning-rate schedule and, with ``--clip-grad-norm``, its
    clipping over the optimizer's parameters (this rank's part of the model)."""
    state.scheduler = make_scheduler(state.optimizer, cfg)
    if cfg.clip_grad_norm is not None:
        params = [p for g in state.optimizer.param_groups for p in g["params"]]
        state.clipper = GradClipper(params, cfg.clip_grad_norm, state.layout, state.groups)
    return state
