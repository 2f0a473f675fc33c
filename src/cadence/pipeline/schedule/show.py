"""What ``cadence schedule show`` prints: grid, simulator statistics, channels, digest.

The argument parser lives with every other ``cadence`` command in ``cadence/cli.py``;
this module is the command's logic, over plain values. It needs no process group
and no torch, like the rest of the schedule layer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from cadence.pipeline.schedule.channels import channel_plan
from cadence.pipeline.schedule.generators import generate
from cadence.pipeline.schedule.ir import Schedule
from cadence.pipeline.schedule.passes import lower
from cadence.pipeline.schedule.sim import ScheduleDeadlockError, verify
from cadence.pipeline.schedule.viz import ascii_grid, chrome_trace, render_png

__all__ = ["load_schedule", "show_schedule"]


def load_schedule(name: str, pp: int, microbatches: int, chunks: int | None) -> Schedule:
    """A generator name, or a ``.csv`` / ``.json`` file (its own p, m and v then apply)."""
    if name.endswith(".csv"):
        return Schedule.from_csv(Path(name))
    if name.endswith(".json"):
        return Schedule.from_json(Path(name))
    return generate(name, pp, microbatches, chunks)


def show_schedule(
    name: str,
    *,
    pp: int = 4,
    microbatches: int = 8,
    chunks: int | None = None,
    out: Path | None = None,
    trace: Path | None = None,
    mode: str = "per_directed_edge",
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Print the schedule's grid, statistics, channels and digest; 0 on success.

    Lowers a compute-only schedule first and verifies it in ``mode``; a schedule the
    simulator rejects prints the wait-for cycle on ``stderr`` and returns 2.
    ``out`` writes a PNG (needs matplotlib), ``trace`` a Chrome trace JSON.
    """
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    sched = load_schedule(name, pp, microbatches, chunks)
    low = sched if sched.meta.lowered else lower(sched)
    try:
        result = verify(low, mode=mode)  # type: ignore[arg-type]  # a CLI str; verify checks it
    except ScheduleDeadlockError as e:
        print(f"simulator rejects the schedule:\n{e}", file=stderr)
        return 2
    meta = low.meta
    print(
        f"{meta.generator}: p={low.num_ranks}, stages={low.num_stages}, m={meta.m}, "
        f"placement={list(low.placement)}",
        file=stdout,
    )
    print(ascii_grid(result), file=stdout)
    print(result.summary(), file=stdout)
    plan = channel_plan(low, mode)
    edges = ", ".join(f"{a}->{b}" for a, b in plan.edges)
    print(f"channels ({len(plan.edges)}): {edges}; digest {plan.digest[:16]}", file=stdout)
    if out is not None:
        render_png(result, out, title=f"{meta.generator} p={low.num_ranks} m={meta.m}")
        print(f"wrote {out}", file=stdout)
    if trace is not None:
        Path(trace).write_text(json.dumps(chrome_trace(result)))
        print(f"wrote {trace}", file=stdout)
    return 0
