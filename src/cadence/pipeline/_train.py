"""``cadence train --pp N --schedule NAME``: pipeline training of the embedded model.

Called by ``cadence/train.py`` (the CLI layer) with plain config values; this file
owns everything pipeline-specific: splitting TinyGPT into stages, placing them,
building the schedule runtime, the optimizer loop and loss logging.

Data: every pipeline group sees the same global batch of a step
(``MarkovTokens.batch(step, batch_size)``); with data parallelism each replica
takes its equal slice, so the run is the same whatever the layout.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from cadence.comm import Comm
from cadence.models import GPTConfig, MarkovTokens, TinyGPT
from cadence.topology import ParallelGroups

__all__ = ["PipelineTrainConfig", "run_pipeline_training"]


@dataclass(frozen=True)
class PipelineTrainConfig:
    """What ``cadence train --pp`` needs; every field has a CLI-friendly default.

    Attributes:
        schedule: generator name (gpipe, 1f1b, interleaved, looped_bfs, zb_h1, zbv, dualpipev).
        n_microbatches: microbatches per step; ``0`` means ``2 * pp``.
        chunks: stages per rank (v); ``0`` picks 1 for gpipe/1f1b and 2 otherwise.
        steps: optimizer steps.
        batch_size: global batch per step (split over dp replicas, then microbatches).
        lr: AdamW learning rate.
        seed: model init and data seed.
        model: the TinyGPT shape (``n_layers`` is raised to one block per stage if needed).
    """

    schedule: str = "1f1b"
    n_microbatches: int = 0
    chunks: int = 0
    steps: int = 20
    batch_size: int = 32
    lr: float = 3e-3
    seed: int = 0
    model: GPTConfig = field(default_factory=GPTConfig)


_TWO_CHUNK = {"interleaved", "interleaved1f1b", "looped_bfs", "loopedbfs", "zbv", "dualpipev"}


def _chunks(cfg: PipelineTrainConfig) -> int:
    if cfg.chunks:
        return cfg.chunks
    return 2 if cfg.schedule.lower().replace("-", "_") in _TWO_CHUNK else 1


def run_pipeline_training(
    cfg: PipelineTrainConfig,
    pg: ParallelGroups,
    log_step: Callable[[int, float], None] | None = None,
) -> dict[str, float | str | int]:
    """Train TinyGPT with pipeline parallelism over ``pg.pp`` (and DP over ``pg.dp``).

    Args:
        cfg: the run's values (see `PipelineTrainConfig`).
        pg: from ``cadence.init(Topology(..., pp=N))``.
        log_step: called on every rank after each step as ``log_step(step, loss)``,
            with the step's mean loss (the same value on every rank).

    Returns:
        ``{"first_loss", "final_loss", "steps", "step_time_median_s", "schedule",
        "pp", "dp", "chunks", "n_microbatches"}``.
    """
    from cadence.pipeline._build import build_pipeline, placement_for

    pp = pg.topology.pp
    dp = pg.topology.dp_size
    v = _chunks(cfg)
    m = cfg.n_microbatches or 2 * pp
    if cfg.batch_size % (dp * m):
        raise ValueError(
            f"batch_size={cfg.batch_size} must be a multiple of dp ({dp}) x "
            f"n_microbatches ({m}) = {dp * m}"
        )
    gcfg = replace(cfg.model, n_layers=max(cfg.model.n_layers, pp * v))
    torch.manual_seed(cfg.seed)
    model = TinyGPT(gcfg)  # same init on every rank; each keeps only its stages
    chunks = model.split_stages(pp * v)
    if dp > 1:
        # Data parallelism inside each stage: the runtime drives it through the
        # public timing verbs only (dp.py). fully_shard takes the ParallelGroups and
        # shards over dp_shard / replicates over dp_replicate.
        from cadence.fsdp import fully_shard

        placement = placement_for(cfg.schedule, pp, v)
        for s, r in placement.items():
            if r == pg.pp_rank:
                fully_shard(chunks[s], group=pg)
    runtime = build_pipeline(
        cfg.schedule,
        chunks,
        n_microbatches=m,
        chunks=v,
        groups=pg,
        loss_fn=TinyGPT.loss,
    )
    params = [p for st in runtime.stages.values() for p in st.module.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    data = MarkovTokens(gcfg.vocab_size, gcfg.seq_len, seed=cfg.seed)
    pp_comm = Comm(pg.pp, name="pp-loss")
    dp_comm = Comm(pg.dp, name="dp-loss") if dp > 1 else None
    last_owner = runtime.placement[runtime.num_stages - 1]
    rows = pg.local_slice(cfg.batch_size)
    first = final = float("nan")
    times = []
    for step in range(cfg.steps):
        x, y = data.batch(step, cfg.batch_size)
        x, y = x[rows], y[rows]
        t0 = time.perf_counter()
        losses: list[torch.Tensor] = []
        runtime.step(x, target=y, losses=losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        # The loss lives on the last stage's rank; broadcast it (and average over DP).
        loss_t = torch.stack(losses).mean().reshape(1) if losses else torch.zeros(1)
        pp_comm.broadcast(loss_t, src=last_owner)
        if dp_comm is not None:
            dp_comm.all_reduce(loss_t, op="avg")
        loss = float(loss_t)
        first = loss if step == 0 else first
        final = loss
        if log_step is not None:
            log_step(step, loss)
    return {
        "first_loss": first,
        "final_loss": final,
        "steps": cfg.steps,
        "step_time_median_s": statistics.median(times) if times else float("nan"),
        "schedule": cfg.schedule,
        "pp": pp,
        "dp": dp,
        "chunks": v,
        "n_microbatches": m,
    }
