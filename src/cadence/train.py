"""``cadence train``: train the embedded TinyGPT on the synthetic Markov task.

Runs on ``--nproc`` local ranks (spawned with `cadence.launch`), or on the ranks
torchrun started (when ``RANK``/``WORLD_SIZE`` are set). Data parallel by default
(`DataParallel`, ``--finalize auto|manual``), fully sharded with ``--fsdp``, and
pipelined with ``--pp N --schedule NAME``. Rank 0 shows a progress bar, prints a
summary table and writes ``metrics.json`` into the run folder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from cadence.models import GPTConfig

__all__ = ["TrainConfig", "add_train_subcommand", "run_rank", "train"]


@dataclass(frozen=True)
class TrainConfig:
    """Values of one ``cadence train`` run (validated at construction)."""

    nproc: int = 2
    steps: int = 150
    batch_size: int = 32
    lr: float = 3e-3
    seed: int = 0
    finalize: str = "auto"
    fsdp: bool = False
    mixed_precision: str = "none"
    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 0
    chunks: int = 0
    model: GPTConfig = field(default_factory=GPTConfig)
    # Small buckets so the tiny model gets several, and its all-reduces overlap backward.
    bucket_cap_mb: float = 0.25
    run_dir: str = ""
    timeout: float = 1800.0

    def __post_init__(self) -> None:
        if self.finalize not in ("auto", "manual"):
            raise ValueError(f"--finalize must be auto or manual, got {self.finalize!r}")
        if self.mixed_precision not in ("none", "bf16"):
            raise ValueError(
                f"--mixed-precision must be none or bf16, got {self.mixed_precision!r}"
            )
        if self.mixed_precision != "none" and not self.fsdp:
            raise ValueError("--mixed-precision needs --fsdp (DataParallel keeps fp32 params)")
        if self.nproc < 1 or self.steps < 1 or self.batch_size < 1:
            raise ValueError("--nproc, --steps and --batch-size must be >= 1")
        if self.pp < 1:
            raise ValueError("--pp must be >= 1")
        if self.pp == 1 and self.batch_size % self.nproc:
            raise ValueError(
                f"--batch-size {self.batch_size} must be divisible by the {self.nproc} ranks"
            )


def _bar(step: int, total: int, loss: float, started: float) -> None:
    """A progress bar on a terminal; one line per tenth of the run in a log file."""
    tty = sys.stderr.isatty()
    if not tty and (step + 1) % max(1, total // 10) and step + 1 != total:
        return
    width = 30
    done = int(width * (step + 1) / total)
    rate = (step + 1) / max(time.perf_counter() - started, 1e-9)
    sys.stderr.write(
        f"{chr(13) if tty else ''}[{'#' * done}{'.' * (width - done)}] step {step + 1}/{total}  "
        f"loss {loss:.4f}  {rate:.1f} it/s"
    )
    if step + 1 == total or not tty:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _data_parallel_run(cfg: TrainConfig, pg: Any, rank: int) -> dict[str, Any]:
    import cadence
    from cadence.models import MarkovTokens, TinyGPT

    world = pg.world_size
    gcfg = cfg.model
    torch.manual_seed(cfg.seed)
    model = TinyGPT(gcfg)
    log = cadence.EventLog()
    if cfg.fsdp:
        mp = None
        if cfg.mixed_precision == "bf16":
            mp = cadence.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        for block in model.blocks:
            cadence.fully_shard(block, group=pg, mp_policy=mp, event_log=log)
        wrapped = cadence.fully_shard(model, group=pg, mp_policy=mp, event_log=log)
    else:
        wrapped = cadence.DataParallel(
            model, group=pg, bucket_cap_mb=cfg.bucket_cap_mb, event_log=log
        )
    manual = cfg.finalize == "manual"
    wrapped.set_manual_backward_finalization(manual)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=cfg.lr)
    data = MarkovTokens(gcfg.vocab_size, gcfg.seq_len, seed=cfg.seed)
    share = cfg.batch_size // world
    loss_comm = cadence.Comm(pg.world, name="loss")
    losses: list[float] = []
    times: list[float] = []
    started = time.perf_counter()
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        x, y = data.batch(step, cfg.batch_size)
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        logits = wrapped(x)
        loss = TinyGPT.loss(logits.float(), y)
        loss.backward()
        metric = loss.detach().reshape(1)
        if manual:
            # The caller owns the timing: the gradient reductions stay in flight while
            # the loss is averaged for logging, and are waited only before the step.
            handle = wrapped.finalize_backward(async_op=True)
            loss_comm.all_reduce(metric, op="avg")
            if handle is not None:
                handle.wait()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        if not manual:
            loss_comm.all_reduce(metric, op="avg")
        losses.append(float(metric))
        if rank == 0:
            _bar(step, cfg.steps, losses[-1], started)
    return {
        "losses": losses,
        "step_time_median_s": statistics.median(times),
        "comm_exposed_s": log.wait_time("all_reduce", "reduce_scatter"),
        "comm_hidden_s": log.in_flight_time("all_reduce", "reduce_scatter"),
        "collectives": log.counts(),
    }


def run_rank(cfg: TrainConfig) -> dict[str, Any]:
    """One rank's whole run (called in each spawned rank, or directly under torchrun)."""
    import cadence

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, cfg.nproc)))
    if cfg.pp > 1:
        world = int(os.environ.get("WORLD_SIZE", cfg.nproc))
        if world % cfg.pp:
            raise ValueError(f"--pp {cfg.pp} must divide the world size {world}")
        topo = cadence.Topology(dp_shard=world // cfg.pp, pp=cfg.pp)
    else:
        topo = None
    pg = cadence.init(topo)
    rank = pg.rank
    if cfg.pp > 1:
        from cadence.pipeline._train import PipelineTrainConfig, run_pipeline_training

        losses: list[float] = []
        started = time.perf_counter()

        def log_step(step: int, loss: float) -> None:
            losses.append(loss)
            if rank == 0:
                _bar(step, cfg.steps, loss, started)

        pcfg = PipelineTrainConfig(
            schedule=cfg.schedule,
            n_microbatches=cfg.microbatches,
            chunks=cfg.chunks,
            steps=cfg.steps,
            batch_size=cfg.batch_size,
            lr=cfg.lr,
            seed=cfg.seed,
            model=cfg.model,
        )
        extra = run_pipeline_training(pcfg, pg, log_step)
        return {
            "losses": losses,
            "step_time_median_s": extra["step_time_median_s"],
            "comm_exposed_s": float("nan"),
            "comm_hidden_s": float("nan"),
            "collectives": {},
            "pipeline": extra,
        }
    return _data_parallel_run(cfg, pg, rank)


def _summary(cfg: TrainConfig, result: dict[str, Any], world: int) -> dict[str, Any]:
    losses = result["losses"]
    tokens_per_step = cfg.batch_size * cfg.model.seq_len
    step_s = result["step_time_median_s"]
    mode = "pipeline" if cfg.pp > 1 else ("fully_shard" if cfg.fsdp else "DataParallel")
    return {
        "mode": mode,
        "world_size": world,
        "finalize": cfg.finalize,
        "steps": len(losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "tokens_per_s": tokens_per_step / step_s if step_s > 0 else float("nan"),
        "step_time_median_ms": step_s * 1e3,
        "comm_exposed_ms_total": result["comm_exposed_s"] * 1e3,
        "comm_hidden_ms_total": result["comm_hidden_s"] * 1e3,
    }


def _ms(value: float) -> str:
    # The pipeline runtime does not split its P2P time into exposed and hidden.
    return "n/a" if value != value else f"{value:.1f} ms"


def _print_table(summary: dict[str, Any], run_dir: Path) -> None:
    rows = [
        ("mode", summary["mode"]),
        ("ranks", summary["world_size"]),
        ("finalize", summary["finalize"]),
        ("steps", summary["steps"]),
        ("first loss", f"{summary['first_loss']:.4f}"),
        ("last loss", f"{summary['last_loss']:.4f}"),
        ("tokens/s", f"{summary['tokens_per_s']:.0f}"),
        ("median step", f"{summary['step_time_median_ms']:.1f} ms"),
        ("comm exposed (total)", _ms(summary["comm_exposed_ms_total"])),
        ("comm hidden (total)", _ms(summary["comm_hidden_ms_total"])),
        ("run folder", str(run_dir)),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 30)
    print(line)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(line)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cadence train``; returns rank 0's summary and writes ``metrics.json``."""
    import cadence

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        result = run_rank(cfg)
        world = int(os.environ["WORLD_SIZE"])
        if int(os.environ["RANK"]) != 0:
            return {}
    else:
        result = cadence.launch(run_rank, cfg, nprocs=cfg.nproc, timeout=cfg.timeout)[0]
        world = cfg.nproc
    run_dir = Path(cfg.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = _summary(cfg, result, world)
    metrics = {"config": asdict(cfg), "summary": summary, "losses": result["losses"]}
    metrics["collectives_rank0"] = result["collectives"]
    if "pipeline" in result:
        metrics["pipeline"] = result["pipeline"]
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    _print_table(summary, run_dir)
    return summary


def add_train_subcommand(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="train the embedded TinyGPT on N local ranks")
    d = TrainConfig()
    p.add_argument(
        "--nproc", type=int, default=d.nproc, help="local ranks (ignored under torchrun)"
    )
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch per step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--finalize", choices=["auto", "manual"], default=d.finalize)
    p.add_argument(
        "--fsdp", action="store_true", help="cadence.fully_shard instead of DataParallel"
    )
    p.add_argument("--mixed-precision", choices=["none", "bf16"], default=d.mixed_precision)
    p.add_argument("--pp", type=int, default=d.pp, help="pipeline stages (ranks)")
    p.add_argument("--schedule", default=d.schedule, help="gpipe, 1f1b, interleaved, zbv, ...")
    p.add_argument("--microbatches", type=int, default=d.microbatches, help="0 = 2 x pp")
    p.add_argument(
        "--chunks", type=int, default=d.chunks, help="stages per rank; 0 = schedule default"
    )
    p.add_argument("--d-model", type=int, default=d.model.d_model)
    p.add_argument("--layers", type=int, default=d.model.n_layers)
    p.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb)
    p.add_argument("--run-dir", default="", help="default runs/<timestamp>")
    p.set_defaults(func=_train_main)


def _train_main(args: argparse.Namespace) -> int:
    cfg = TrainConfig(
        nproc=args.nproc,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        finalize=args.finalize,
        fsdp=args.fsdp,
        mixed_precision=args.mixed_precision,
        pp=args.pp,
        schedule=args.schedule,
        microbatches=args.microbatches,
        chunks=args.chunks,
        model=GPTConfig(d_model=args.d_model, n_layers=args.layers),
        bucket_cap_mb=args.bucket_cap_mb,
        run_dir=args.run_dir,
    )
    train(cfg)
    return 0
