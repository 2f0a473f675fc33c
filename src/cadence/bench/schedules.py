"""``cadence bench schedules``: building and proving schedules at scale, against torch.

For every generator and for p = 8 .. 128 ranks with m = 4p microbatches, one
process times:

- cadence's *build*: ``generate`` + ``lower`` (the lowered lists a rank executes);
- cadence's *proof*: ``verify`` (every lowered rule, then the strict simulation);
- torch's build of the same schedule (``torch_schedule_name``), where torch has a
  schedule class: constructing it with fake stages (``_calculate_single_rank_operations``
  for every rank, i.e. its ``pipeline_order``), plus its own lowering
  (``_PipelineScheduleRuntime._prepare_schedule_with_comms``: UNSHARD/RESHARD and
  SEND/RECV), exactly what ``get_schedule_ops(..., with_comms=True)`` runs.

[Note: the fair comparison]
Both sides build the lowered action lists of all ranks from nothing, since both
are pure functions of (p, m, v) that every rank evaluates. torch proves nothing
(no simulation, no FIFO or deadlock check), so only the build is compared (target
<= 1.0); the proof is reported beside it, as a multiple of cadence's build. The
fake stages are ``mock.create_autospec`` objects, as torch's own visualiser builds
them; their attribute reads are part of torch's time. One repetition per size:
the sizes span 64x in actions, and the fitted log-log slope over them is the
figure to read; a size whose projected time exceeds the cap is skipped (and said).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from cadence.bench._loop import loadavg
from cadence.bench._record import make_record, ratio_summary

__all__ = ["SIZES", "measure_cadence", "measure_torch", "run", "slope", "write_chart"]

TARGET = 1.0
SIZES = [(8, 32), (16, 64), (32, 128), (64, 256), (128, 512)]
QUICK_SIZES = SIZES[:4]
TINY_SIZES = [(2, 8), (4, 16)]
CAP_S = 150.0  # a size is skipped once the previous one projects beyond this
GROWTH = 4.5  # the next size has 4x the actions; allow a little over for projecting


def measure_cadence(name: str, p: int, m: int) -> dict[str, float]:
    """Seconds of cadence's build (generate + lower), channel plan and proof (verify)."""
    from cadence.pipeline.schedule import channel_plan, generate, lower, verify

    t0 = time.perf_counter()
    low = lower(generate(name, p, m))
    t1 = time.perf_counter()
    channel_plan(low)
    t2 = time.perf_counter()
    verify(low)
    t3 = time.perf_counter()
    return {
        "actions": float(sum(len(acts) for acts in low.ranks)),
        "build": t1 - t0,
        "plan": t2 - t1,
        "proof": t3 - t2,
    }


def measure_torch(name: str, p: int, m: int) -> dict[str, float] | str:
    """torch's construction + lowering of the same schedule, or why there is none."""
    from unittest import mock

    try:
        from torch.distributed.pipelining import schedules as ts
        from torch.distributed.pipelining.stage import PipelineStage
    except ImportError:
        return "no torch"
    from cadence.pipeline.schedule import default_chunks, torch_schedule_name

    v = default_chunks(name)
    try:
        cls = ts.get_schedule_class(torch_schedule_name(name))
    except ValueError as e:
        return f"torch has no {torch_schedule_name(name)} ({e})"
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, p, None
    stage.num_stages = p * v
    stages: Any = stage if issubclass(cls, ts.PipelineScheduleSingle) else [stage] * v
    try:
        t0 = time.perf_counter()
        sched = cls(stages, m)
        t1 = time.perf_counter()
        order = sched.pipeline_order
        if order is None:
            return "no pipeline_order (a hand-written loop)"
        runtime = ts._PipelineScheduleRuntime(stages if isinstance(stages, list) else [stages], m)
        runtime._prepare_schedule_with_comms(order)
        t2 = time.perf_counter()
    except Exception as e:  # torch refuses the size, or its IR
        return f"torch raised {type(e).__name__}: {str(e)[:80]}"
    actions = sum(len(runtime.pipeline_order_with_comms[r]) for r in range(p))
    return {"actions": float(actions), "construct": t1 - t0, "lower": t2 - t1, "build": t2 - t0}


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(time) over log(actions): 1.0 is linear."""
    pts = [(math.log(x), math.log(y)) for x, y in points if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


def run(*, quick: bool, tiny: bool = False, cap_s: float = CAP_S) -> dict[str, Any]:
    """Time every generator at every size and return one record (not yet written)."""
    from cadence.pipeline.schedule import SCHEDULE_NAMES

    sizes = TINY_SIZES if tiny else QUICK_SIZES if quick else SIZES
    load0 = loadavg()
    rows: list[dict[str, Any]] = []
    series: dict[str, dict[str, list[list[float]]]] = {}
    capped: list[str] = []
    for name in SCHEDULE_NAMES:
        last_c = last_t = 0.0
        lines: dict[str, list[list[float]]] = {"build": [], "proof": [], "torch build": []}
        for p, m in sizes:
            if last_c * GROWTH > cap_s:
                capped.append(f"{name} p={p} m={m}")
                continue
            c = measure_cadence(name, p, m)
            last_c = c["build"] + c["proof"]
            lines["build"].append([c["actions"], c["build"]])
            lines["proof"].append([c["actions"], c["proof"]])
            t: dict[str, float] | str
            if last_t * GROWTH > cap_s:
                t = f"skipped: projected over {cap_s:.0f} s"
            else:
                t = measure_torch(name, p, m)
            extra: dict[str, Any] = {
                "actions": int(c["actions"]),
                "build_s": c["build"],
                "proof_s": c["proof"],
                "plan_s": c["plan"],
                "proof/build": c["proof"] / c["build"],
            }
            ratio = None
            if isinstance(t, dict):
                last_t = t["build"]
                lines["torch build"].append([t["actions"], t["build"]])
                ratio = ratio_summary([c["build"] / t["build"]])
                extra.update(
                    torch_actions=int(t["actions"]),
                    torch_construct_s=t["construct"],
                    torch_lower_s=t["lower"],
                )
            else:
                extra["torch"] = t
            rows.append(
                {
                    "case": f"{name} p={p} m={m}",
                    "metric": "build (generate + lower) vs torch",
                    "ratio": ratio,
                    "aa": None,
                    "target": TARGET if ratio is not None else None,
                    "extra": extra,
                }
            )
        series[name] = lines
    slopes = {
        name: {k: slope([(x, y) for x, y in pts]) for k, pts in lines.items()}
        for name, lines in series.items()
    }
    record = make_record(
        "schedules",
        quick=quick,
        rows=rows,
        load_before=load0,
        settings={
            "sizes": " ".join(f"{p}x{m}" for p, m in sizes),
            "repetitions": 1,
            "cap_s": cap_s,
            "capped": ", ".join(capped) or "none",
        },
    )
    record["series"] = series
    record["slopes"] = slopes
    return record


def write_chart(record: dict[str, Any], path: Path) -> Path | None:
    """Log-log time vs actions per generator, with each line's fitted slope."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    series, slopes = record["series"], record["slopes"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 5), sharey=True)
    for ax, what in zip(axes, ("build", "proof", "torch build"), strict=True):
        for name, lines in series.items():
            pts = lines[what]
            if not pts:
                continue
            k = slopes[name][what]
            label = f"{name} (slope {k:.2f})" if k is not None else name
            ax.loglog([x for x, _ in pts], [y for _, y in pts], "o-", ms=3, label=label)
        ax.set_title(f"{'cadence ' if what != 'torch build' else ''}{what}", fontsize=10)
        ax.set_xlabel("actions (all ranks, lowered)")
        ax.grid(True, which="both", lw=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("seconds (one process, one repetition)")
    load = record["machine"]["loadavg"][0]
    fig.suptitle(
        f"cadence bench schedules: {record['machine']['cpu_count']} CPUs, load {load:.1f}, "
        f"{record['created']} (slope 1.0 = linear)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
