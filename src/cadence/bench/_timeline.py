"""One picture per whole-step case on a link: where each variant's step spends its time.

Each variant is a lane: its step cut at the marks its step function sets (before its
last backward, that backward, what follows: the optimizer, the sparse half), one step
traced after the timed ones, on rank 0's clock from the step's start. Under cadence's
lane, each collective its wrapper issued is a bar from issue to the end of its wait
(in flight: lighter; the part spent blocked in ``wait()``: darker), so a picture shows
what overlapped and what was exposed. torch's wrappers keep no such log: their lanes
show the phases only. Under every variant's phases, a grey strip shows the link's
wire through that step (`cadence.bench._wire_trace`): the darker, the more of the
link's rate its bytes used in each 2 ms, every rank's together. A dashed line marks
the bound perfect overlap allows (see `cadence.bench._bound`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cadence.bench._wire_trace import BIN_S, utilization

__all__ = ["write_timeline"]

_PHASES = (("before last backward", "#9ecae1"), ("last backward", "#3182bd"), ("after", "#fd8d3c"))
_ORDER = ("plain", "cadence", "cadence_sync", "torch", "torch_best", "torch_b")


_SUBLANES = 4


def _pack(events: list[Any]) -> list[int]:
    """A sub-lane per event, so that overlapping collectives stay visible: the first
    sub-lane free at its issue, else (at most `_SUBLANES`) the one that frees first."""
    ends: list[float] = []
    out = []
    for _, _, issue, _, wait_end in events:
        end = wait_end if wait_end is not None else issue
        free = [i for i, e in enumerate(ends) if e <= issue]
        if free:
            i = free[0]
        elif len(ends) < _SUBLANES:
            ends.append(0.0)
            i = len(ends) - 1
        else:
            i = min(range(len(ends)), key=ends.__getitem__)
        ends[i] = max(ends[i], end)
        out.append(i)
    return out


def write_timeline(row: dict[str, Any], path: Path, title: str) -> Path | None:
    """Draw ``row["trace"]`` into ``path``; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    trace: dict[str, Any] = row["trace"]
    variants = [v for v in _ORDER if v in trace]
    events = trace.get("cadence", {}).get("events", [])
    lanes: list[tuple[str, str, Any]] = []  # (label, kind, payload)
    for v in variants:
        lanes.append((v, "phases", trace[v]["marks"]))
        if v == "cadence":
            groups = sorted({e[1] for e in events})
            for g in groups:
                lanes.append((f"  {g} collectives", "events", [e for e in events if e[1] == g]))
    rate = float(row.get("link", {}).get("rate_bps") or 0.0)
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(lanes) + 1.6))
    for y, (label, kind, payload) in enumerate(reversed(lanes)):
        if kind == "phases":
            marks = payload
            for (_, color), a, b in zip(_PHASES, marks, marks[1:], strict=False):
                ax.barh(y + 0.08, 1e3 * (b - a), left=1e3 * a, color=color, height=0.54)
            for start, used in utilization(trace[label].get("wire", []), rate):
                if used > 0.02:
                    ax.barh(y - 0.29, 1e3 * BIN_S, left=1e3 * start, height=0.12,
                            color=str(round(1.0 - 0.85 * used, 3)), lw=0)  # fmt: skip
        else:
            rows = _pack(payload)
            n = max(1, max(rows, default=0) + 1)
            for i, (_, _, issue, wait_start, wait_end) in zip(rows, payload, strict=True):
                h, off = 0.7 / n, -0.35 + (i + 0.5) * 0.7 / n
                end = wait_end if wait_end is not None else issue
                ax.barh(y + off, 1e3 * (end - issue), left=1e3 * issue, height=h, color="#a1d99b")
                if wait_start is not None and wait_end is not None:
                    ax.barh(y + off, 1e3 * (wait_end - wait_start), left=1e3 * wait_start,
                            height=h, color="#31a354")  # fmt: skip
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([label for label, _, _ in reversed(lanes)])
    link = row.get("link", {})
    if "cadence" in link:
        ax.axvline(link["cadence"]["bound_ms"], ls="--", color="k", lw=1)
        ax.axvline(link["compute_ms"], ls=":", color="grey", lw=1)
    handles = [Rectangle((0, 0), 1, 1, color=c) for _, c in _PHASES]
    handles += [Rectangle((0, 0), 1, 1, color=c) for c in ("#a1d99b", "#31a354")]
    handles.append(Rectangle((0, 0), 1, 1, color="0.15"))
    names = [n for n, _ in _PHASES] + ["collective in flight", "blocked in wait()"]
    names.append("wire busy (darker: more of the rate)")
    ax.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3,
              fontsize=8, frameon=False)  # fmt: skip
    ax.set_xlabel("ms from the step's start (rank 0); dashed: bound, dotted: compute alone")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
