"""The ``cadence`` command: every subcommand's parser, in one place.

- ``cadence train``: train the embedded TinyGPT (`cadence.train`).
- ``cadence schedule show``: a pipeline schedule's grid, simulator statistics,
  channels and digest (`cadence.pipeline.schedule.show`).

Building the parser imports no torch; a subcommand imports what it needs when it
runs, so ``cadence schedule show`` and ``cadence --help`` work where torch is not
installed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cadence.models.config import GPTConfig
from cadence.pipeline.schedule.channels import CHANNEL_MODES
from cadence.pipeline.schedule.generators import SCHEDULE_NAMES
from cadence.train.config import TrainConfig

__all__ = ["add_schedule_subcommand", "add_train_subcommand", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cadence",
        description="Distributed training in which the caller owns the timing.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_subcommand(sub)
    add_schedule_subcommand(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


# -- cadence train ----------------------------------------------------------------


def add_train_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``train`` to an argparse sub-parser collection."""
    p = subparsers.add_parser("train", help="train the embedded TinyGPT on N local ranks")
    d = TrainConfig()
    p.add_argument(
        "--nproc", type=int, default=d.nproc, help="local ranks (ignored under torchrun)"
    )
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch per step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--finalize",
        choices=["auto", "manual"],
        default=d.finalize,
        help="pp=1: finish reductions after backward (auto) or after the loss all-reduce",
    )
    p.add_argument(
        "--fsdp", action="store_true", help="cadence.fully_shard instead of DataParallel"
    )
    p.add_argument("--mixed-precision", choices=["none", "bf16"], default=d.mixed_precision)
    p.add_argument("--pp", type=int, default=d.pp, help="pipeline stages (ranks)")
    p.add_argument(
        "--schedule", default=d.schedule, help=f"with --pp: {', '.join(SCHEDULE_NAMES)} (1f1b)"
    )
    p.add_argument("--microbatches", type=int, default=d.microbatches, help="with --pp; 0 = 2 x pp")
    p.add_argument(
        "--chunks", type=int, default=d.chunks, help="with --pp: stages per rank; 0 = default"
    )
    p.add_argument("--d-model", type=int, default=d.model.d_model)
    p.add_argument("--layers", type=int, default=d.model.n_layers)
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=d.bucket_cap_mb,
        help="DataParallel bucket size (default 0.25)",
    )
    p.add_argument("--run-dir", default="", help="default runs/<timestamp>")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        metavar="K",
        help="checkpoint to RUN_DIR/checkpoints/step-<N> every K steps and after the last",
    )
    p.add_argument(
        "--keep", type=int, default=d.keep, metavar="N", help="keep the newest N checkpoints"
    )
    p.add_argument(
        "--async-checkpoint", action="store_true", help="write checkpoints in the background"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in --run-dir (else start fresh)",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=d.collective_timeout,
        metavar="S",
        help="seconds a collective waits for its peers before the rank stops with an error",
    )
    p.set_defaults(func=_train)
    return p


def _train(args: argparse.Namespace) -> int:
    from cadence.train.run import train  # imports torch: only when training runs

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
        checkpoint_every=args.checkpoint_every,
        keep=args.keep,
        async_checkpoint=args.async_checkpoint,
        resume=args.resume,
        collective_timeout=args.collective_timeout,
    )
    train(cfg)
    return 0


# -- cadence schedule show --------------------------------------------------------


def add_schedule_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``schedule show`` to an argparse sub-parser collection."""
    parser = subparsers.add_parser("schedule", help="inspect pipeline schedules (no process group)")
    sub = parser.add_subparsers(dest="schedule_command", required=True)
    show = sub.add_parser("show", help="ASCII grid, PNG and simulator statistics of a schedule")
    show.add_argument("name", help=f"{', '.join(SCHEDULE_NAMES)}, or a .csv/.json file")
    show.add_argument("--pp", type=int, default=4, help="pipeline ranks p")
    show.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches m")
    show.add_argument(
        "--chunks", type=int, default=None, help="stages per rank v (default per schedule)"
    )
    show.add_argument("--out", type=Path, default=None, help="write a PNG here (needs matplotlib)")
    show.add_argument("--trace", type=Path, default=None, help="write a Chrome trace JSON here")
    show.add_argument("--mode", default="per_directed_edge", choices=list(CHANNEL_MODES))
    show.set_defaults(func=_schedule_show)
    return parser


def _schedule_show(args: argparse.Namespace) -> int:
    from cadence.pipeline.schedule.show import show_schedule

    return show_schedule(
        str(args.name),
        pp=args.pp,
        microbatches=args.microbatches,
        chunks=args.chunks,
        out=args.out,
        trace=args.trace,
        mode=args.mode,
    )


if __name__ == "__main__":
    sys.exit(main())
