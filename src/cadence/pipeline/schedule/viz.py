"""Pictures of a schedule: an ASCII grid, a PNG (matplotlib, optional, Agg) and a
Chrome trace.

All three are drawn from a `SimResult` of the lowered schedule, so they show
simulated times, not a step index: one row per rank, F/B/I/W coloured, and an
arrow per message from its send to its receive.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from cadence.pipeline.schedule.sim import SimResult

__all__ = ["COLOURS", "ascii_grid", "chrome_trace", "render_png"]

COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868", "OVERLAP_F_B": "#8172b3"}


def _kind(name: str) -> str:
    if name.endswith("OVERLAP_F_B"):
        return "OVERLAP_F_B"
    return next(c for c in name if c.isalpha())


def ascii_grid(result: SimResult, *, cell: float | None = None) -> str:
    """One row per rank; each column is ``cell`` time units; ``.`` is idle.

    A cell shows the kind letter and the microbatch's last digit (``F3``) of the
    action that starts in it; ``=`` continues a longer action.
    """
    if not result.events:
        return "(empty schedule)"
    durations = [e - s for _, _, s, e in result.events if e > s]
    unit = cell or min(durations)
    cols = math.ceil(result.makespan / unit - 1e-9)
    ranks = sorted({e[0] for e in result.events})
    lines = ["time/" + f"{unit:g}: " + "".join(f"{c % 10:<3d}" for c in range(cols))]
    for r in ranks:
        row = [" . "] * cols
        for rr, name, s, e in result.events:
            if rr != r:
                continue
            a, b = round(s / unit), math.ceil(e / unit - 1e-9)
            kind = _kind(name)
            label = "X" if kind == "OVERLAP_F_B" else kind
            mb = "".join(
                ch for ch in name.split(label if label != "X" else ")")[-1] if ch.isdigit()
            )[-1:]
            for c in range(a, min(b, cols)):
                row[c] = f"{label}{mb:<2}" if c == a else "== "
        lines.append(f"rank {r:<4}: " + "".join(row))
    return "\n".join(lines)


def render_png(
    result: SimResult, path: str | Path, *, title: str = "", arrows: bool = True
) -> Path:
    """Write a PNG timeline. Needs matplotlib (optional dependency), Agg backend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("render_png needs matplotlib: pip install matplotlib") from e
    ranks = sorted({e[0] for e in result.events})
    fig, ax = plt.subplots(figsize=(max(8.0, result.makespan * 0.35), 0.6 * len(ranks) + 1.5))
    for r, name, s, end in result.events:
        kind = _kind(name)
        ax.broken_barh(
            [(s, end - s)],
            (r - 0.4, 0.8),
            facecolors=COLOURS[kind],
            edgecolor="black",
            linewidth=0.4,
        )
        if end - s >= 0.3:
            ax.text(
                (s + end) / 2,
                r,
                name.split(")")[0].lstrip("("),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    if arrows:
        for src, dst, ts, tr, _ in result.flows:
            ax.annotate(
                "",
                xy=(tr, dst),
                xytext=(ts, src),
                arrowprops={"arrowstyle": "->", "color": "grey", "lw": 0.5, "alpha": 0.6},
            )
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (simulated units)")
    ax.set_title(title or f"makespan {result.makespan:g}, bubble {result.bubble:.3f}")
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in COLOURS.items()],
        loc="upper right",
        fontsize=7,
        ncol=5,
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def chrome_trace(result: SimResult, *, time_unit_us: float = 1000.0) -> dict[str, Any]:
    """Chrome trace JSON (chrome://tracing, Perfetto): one process per rank,
    compute as complete events, each message as a send->recv flow arrow."""
    ev: list[dict[str, Any]] = []
    for r in sorted({e[0] for e in result.events}):
        ev.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
    for r, name, start, end in result.events:
        ev.append(
            {
                "ph": "X",
                "name": name,
                "pid": r,
                "tid": 0,
                "ts": start * time_unit_us,
                "dur": (end - start) * time_unit_us,
            }
        )
    for k, (src, dst, ts, tr, label) in enumerate(result.flows):
        ev.append(
            {
                "ph": "s",
                "id": k,
                "name": label,
                "cat": "p2p",
                "pid": src,
                "tid": 0,
                "ts": ts * time_unit_us,
            }
        )
        ev.append(
            {
                "ph": "f",
                "bp": "e",
                "id": k,
                "name": label,
                "cat": "p2p",
                "pid": dst,
                "tid": 0,
                "ts": tr * time_unit_us,
            }
        )
    return {"traceEvents": ev, "displayTimeUnit": "ms"}
