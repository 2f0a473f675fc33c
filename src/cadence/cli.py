"""The ``cadence`` command: ``cadence train``, ``cadence schedule show``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cadence",
        description="Distributed training in which the caller owns the timing.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from cadence.train import add_train_subcommand

    add_train_subcommand(sub)
    try:
        from cadence.pipeline.cli import add_schedule_subcommand
    except ImportError:  # the pipeline tooling ships with cadence; keep train usable regardless
        pass
    else:
        add_schedule_subcommand(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
