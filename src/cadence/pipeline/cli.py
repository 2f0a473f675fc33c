"""``cadence schedule show NAME --pp 4 --microbatches 8 [--chunks 2] [--out f.png]``.

`add_schedule_subcommand(subparsers)` is what the ``cadence`` console script
wires in; ``python -m cadence.pipeline.cli schedule show ...`` works too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_schedule_subcommand", "main", "show"]


def add_schedule_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``schedule show`` to an argparse sub-parser collection."""
    parser = subparsers.add_parser("schedule", help="inspect pipeline schedules (no process group)")
    sub = parser.add_subparsers(dest="schedule_command", required=True)
    show_p = sub.add_parser("show", help="ASCII grid, PNG and simulator statistics of a schedule")
    show_p.add_argument("name", help="gpipe, 1f1b, interleaved, looped_bfs, zb_h1, zbv, dualpipev, or a .csv/.json file")
    show_p.add_argument("--pp", type=int, default=4, help="pipeline ranks p")
    show_p.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches m")
    show_p.add_argument("--chunks", type=int, default=None, help="stages per rank v (default per schedule)")
    show_p.add_argument("--out", type=Path, default=None, help="write a PNG here (needs matplotlib)")
    show_p.add_argument("--trace", type=Path, default=None, help="write a Chrome trace JSON here")
    show_p.add_argument("--mode", default="per_directed_edge", choices=["shared", "per_direction", "per_directed_edge"])
    show_p.set_defaults(func=show)
    return parser


def show(args: argparse.Namespace) -> int:
    from cadence.pipeline.generators import generate
    from cadence.pipeline.ir import Schedule
    from cadence.pipeline.passes import lower
    from cadence.pipeline.sim import ScheduleDeadlockError, chrome_trace, verify
    from cadence.pipeline.topology import channel_plan
    from cadence.pipeline.viz import ascii_grid, render_png

    name = str(args.name)
    if name.endswith(".csv"):
        sched = Schedule.from_csv(Path(name))
    elif name.endswith(".json"):
        sched = Schedule.from_json(Path(name))
    else:
        sched = generate(name, args.pp, args.microbatches, args.chunks)
    low = sched if sched.meta.lowered else lower(sched)
    try:
        result = verify(low, mode=args.mode)
    except ScheduleDeadlockError as e:
        print(f"simulator rejects the schedule:\n{e}", file=sys.stderr)
        return 2
    meta = low.meta
    print(f"{meta.generator}: p={low.num_ranks}, stages={low.num_stages}, m={meta.m}, placement={list(low.placement)}")
    print(ascii_grid(result))
    print(result.summary())
    plan = channel_plan(low, args.mode)
    print(f"channels ({len(plan.edges)}): {', '.join(f'{a}->{b}' for a, b in plan.edges)}; digest {plan.digest[:16]}")
    if args.out is not None:
        render_png(result, args.out, title=f"{meta.generator} p={low.num_ranks} m={meta.m}")
        print(f"wrote {args.out}")
    if args.trace is not None:
        args.trace.write_text(json.dumps(chrome_trace(result)))
        print(f"wrote {args.trace}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cadence")
    add_schedule_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
