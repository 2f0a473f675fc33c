"""The pictures rank 0 leaves in the run folder: ``loss.png`` and ``timeline.png``.

matplotlib is optional (``pip install cadence[viz]``): without it the run says so
once and writes no pictures. Rendered with the Agg backend, so no display is needed.

- ``loss.png``: every step's loss (across restarts), the held-out loss of each
  evaluation (``--eval-every``), a dotted line at each checkpoint, a red line at
  each step a restart continued from.
- ``timeline.png``: the last `TIMELINE_STEPS` steps of every rank on its own clock
  (each rank starts at its first shown step): the step's span (compute),
  communication in flight (issued, not yet waited: overlapped with compute) and
  exposed waits (blocked in ``wait()``), from the `EventLog` of the data-parallel
  wrappers. Each rank sends rank 0 at most `TIMELINE_MAX_EVENTS` communication
  events (the latest), so rank 0's memory stays bounded at any world size; the
  title and ``metrics.json["timeline_bounds"]`` say how many were dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cadence.train.history import RunHistory

__all__ = [
    "TIMELINE_MAX_EVENTS",
    "TIMELINE_STEPS",
    "TimelineEvent",
    "capped_timeline",
    "timeline_events",
    "write_plots",
]

TIMELINE_STEPS = 3
TIMELINE_MAX_EVENTS = 512  # communication events per rank; step spans are always kept

# (kind, group, issue_t, wait_start_t, wait_end_t); kind "step" spans a step:
# group is the step number, issue_t its start and wait_end_t its end.
TimelineEvent = tuple[str, str, float, float | None, float | None]


def timeline_events(log: Any, steps: int = 3) -> list[TimelineEvent]:
    """The last ``steps`` complete steps of an `EventLog`, compact and picklable."""
    starts = {e.meta["step"]: e.issue_t for e in log.marks("step")}
    ends = {e.meta["step"]: e.issue_t for e in log.marks("step_end")}
    shown = sorted(s for s in ends if s in starts)[-steps:]
    if not shown:
        return []
    lo, hi = starts[shown[0]], ends[shown[-1]]
    out: list[TimelineEvent] = [("step", str(s), starts[s], None, ends[s]) for s in shown]
    out += [
        (e.kind, e.group, e.issue_t, e.wait_start_t, e.wait_end_t)
        for e in log.collectives()
        if lo <= e.issue_t <= hi
    ]
    return out


def capped_timeline(
    log: Any, steps: int = TIMELINE_STEPS, max_events: int = TIMELINE_MAX_EVENTS
) -> tuple[list[TimelineEvent], int]:
    """`timeline_events` with the latest ``max_events`` communication events at most,
    and how many earlier ones were dropped."""
    events = timeline_events(log, steps)
    spans = [e for e in events if e[0] == "step"]
    comms = [e for e in events if e[0] != "step"]
    kept = comms[len(comms) - max_events :] if len(comms) > max_events else comms
    return spans + kept, len(comms) - len(kept)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_loss(plt: Any, history: RunHistory, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4))
    steps = range(1, len(history.losses) + 1)
    ax.plot(steps, history.losses, color="tab:blue", lw=1.5, label="loss")
    if history.evals:
        at, held_out = zip(*history.evals)
        ax.plot(at, held_out, "o-", color="tab:orange", lw=1.5, ms=4, label="held-out loss")
    for i, s in enumerate(history.checkpoints):
        ax.axvline(s, color="grey", ls=":", lw=1, label="checkpoint" if i == 0 else None)
    for i, s in enumerate(history.resumes):
        ax.axvline(s, color="tab:red", lw=1.5, label="restart (resumed here)" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("cadence train: loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_timeline(plt: Any, per_rank: list[list[TimelineEvent]], path: Path, note: str) -> None:
    fig, ax = plt.subplots(figsize=(10, 1 + 0.8 * len(per_rank)))
    labels = {"step": "compute (step)", "flight": "comm in flight", "wait": "exposed wait"}
    used: set[str] = set()

    def bar(y: float, start: float, end: float, h: float, color: str, key: str) -> None:
        ax.broken_barh(
            [(start * 1e3, max(end - start, 0.0) * 1e3)],
            (y - h / 2, h),
            color=color,
            label=None if key in used else labels[key],
        )
        used.add(key)

    for rank, events in enumerate(per_rank):
        steps = [e for e in events if e[0] == "step"]
        if not steps:
            continue
        t0 = min(e[2] for e in steps)
        for _, name, start, _, end in steps:
            assert end is not None
            bar(rank, start - t0, end - t0, 0.7, "#c8d6e5", "step")
            ax.text((start - t0) * 1e3, rank + 0.38, f"step {name}", fontsize=7, va="bottom")
        for kind, _, issue, wait_start, wait_end in events:
            if kind == "step" or wait_start is None:
                continue
            bar(rank, issue - t0, wait_start - t0, 0.25, "tab:blue", "flight")
            if wait_end is not None:
                bar(rank, wait_start - t0, wait_end - t0, 0.45, "tab:red", "wait")
    ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the rank's first shown step")
    ax.set_title("cadence train: per-rank timeline" + (f"\n{note}" if note else ""), fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(
    run_dir: Path, history: RunHistory, per_rank: list[list[TimelineEvent]], note: str = ""
) -> list[Path] | str:
    """Write ``loss.png`` and ``timeline.png`` (``note`` under its title); returns their
    paths, or why not."""
    try:
        plt = _pyplot()
    except ImportError:
        return "no plots: matplotlib is not installed (pip install 'cadence[viz]')"
    loss, timeline = run_dir / "loss.png", run_dir / "timeline.png"
    _plot_loss(plt, history, loss)
    _plot_timeline(plt, per_rank, timeline, note)
    return [loss, timeline]
