"""Bench records: the machine, ratio summaries, the JSON file and its chart.

A record is one ``cadence bench KIND`` run::

    {"kind": "dp", "quick": true, "created": "2026-...Z", "machine": {...},
     "rows": [{"case": ..., "metric": "step time", "ratio": SUMMARY, "aa": SUMMARY,
               "target": 0.95, "abs_ms": {...}, "extra": {...}}, ...]}

``SUMMARY`` is ``{"median", "min", "max", "q1", "q3", "n"}`` over per-repetition
ratios. ``ratio`` is cadence / torch; ``aa`` is torch / a second, identical torch
(the A/A noise figure: how far from 1.00 two runs of the same code land on this
machine at this moment). Lower than 1 is better for cadence.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "RECORD_VERSION",
    "default_results_dir",
    "machine_info",
    "make_record",
    "paired_ratios",
    "ratio_summary",
    "timed_row",
    "write_chart",
    "write_record",
]

RECORD_VERSION = 1


def default_results_dir() -> Path:
    """Where a run writes without ``--results``: the user's cache, never the folder the
    command runs from (a record appearing in whatever folder one stood in is a
    surprise). ``$XDG_CACHE_HOME/cadence/bench``, else ``~/.cache/cadence/bench``."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "cadence" / "bench"


def machine_info() -> dict[str, Any]:
    """Core count, load averages and versions: what a reader needs to judge a figure."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # the pickle bench runs without torch
        info["torch"] = None
        info["cuda"] = None
    return info


def ratio_summary(ratios: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and range of per-repetition ratios."""
    rs = sorted(ratios)
    if not rs:
        raise ValueError("no ratios to summarise")
    if len(rs) >= 2:
        q1, _, q3 = statistics.quantiles(rs, n=4, method="inclusive")
    else:
        q1 = q3 = rs[0]
    return {
        "median": statistics.median(rs),
        "min": rs[0],
        "max": rs[-1],
        "q1": q1,
        "q3": q3,
        "n": len(rs),
    }


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """a[i] / b[i]: repetitions are interleaved, so the pairs saw the same machine state."""
    return [x / y for x, y in zip(a, b, strict=True)]


def _median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


def timed_row(
    case: str,
    times: dict[str, list[float]],
    *,
    mine: str,
    ref: str,
    ref_b: str | None,
    target: float | None,
    metric: str = "step time",
    what: str | None = None,
    extra: dict[str, Any] | None = None,
    aa_of: str | None = None,
    abs_name: str = "abs_ms",
    absolute: Callable[[list[float]], float] = _median_ms,
) -> dict[str, Any]:
    """One row: ``mine`` / ``ref`` per repetition, and the A/A noise ``aa_of`` / ``ref_b``
    (``aa_of`` defaults to ``ref``; a question that compares against a variant with no
    identical twin names the twin's original here). ``ref_b=None`` records ``aa: None``:
    the question has no second copy to measure noise with. ``abs_name`` holds every
    variant's absolute figure (median milliseconds unless ``absolute`` says otherwise)."""
    row: dict[str, Any] = {"case": case}
    if what is not None:
        row["what"] = what
    aa = None
    if ref_b is not None:
        aa = ratio_summary(paired_ratios(times[aa_of or ref], times[ref_b]))
    row.update(
        {
            "metric": metric,
            "ratio": ratio_summary(paired_ratios(times[mine], times[ref])),
            "aa": aa,
            "target": target,
            abs_name: {k: absolute(v) for k, v in times.items()},
        }
    )
    if extra is not None:
        row["extra"] = extra
    return row


def make_record(
    kind: str,
    *,
    quick: bool,
    rows: list[dict[str, Any]],
    load_before: list[float],
    settings: dict[str, Any],
) -> dict[str, Any]:
    from cadence.link import active_link

    machine = machine_info()
    machine["loadavg_before"] = load_before
    link = active_link()
    if link is not None:  # the run's ranks were on an emulated link: say which
        settings = {**settings, **link.as_settings()}
    return {
        "version": RECORD_VERSION,
        "kind": kind,
        "quick": quick,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine,
        "settings": settings,
        "rows": rows,
    }


def write_record(record: dict[str, Any], out_dir: Path) -> Path:
    """Write ``<kind>-<timestamp>.json`` (and keep earlier records: they are history)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = record["created"].replace(":", "").replace("-", "")
    path = out_dir / f"{record['kind']}-{stamp}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def write_chart(record: dict[str, Any], path: Path) -> Path | None:
    """One horizontal box per row: cadence/torch ratio (colour) and the A/A noise (grey).

    Returns None when matplotlib is missing (``pip install cadence[viz]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = record["rows"]
    labels = [f"{r['case']}: {r['metric']}" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6))
    for i, row in enumerate(rows):
        y = len(rows) - 1 - i
        for summary, dy, colour in (
            (row["ratio"], 0.12, "tab:blue"),
            (row.get("aa"), -0.12, "0.6"),
        ):
            if summary is None:
                continue
            ax.plot([summary["min"], summary["max"]], [y + dy] * 2, color=colour, lw=1)
            ax.plot([summary["q1"], summary["q3"]], [y + dy] * 2, color=colour, lw=5)
            ax.plot([summary["median"]], [y + dy], "o", color="k", ms=3)
        if row.get("target") is not None:
            ax.plot([row["target"]] * 2, [y - 0.35, y + 0.35], color="tab:red", lw=1)
    ax.axvline(1.0, color="k", lw=0.5, ls=":")
    ax.set_yticks(range(len(rows)), list(reversed(labels)), fontsize=7)
    ax.set_xlabel("cadence / torch (blue), torch / torch A/A (grey); red: target")
    load = record["machine"]["loadavg"][0]
    ax.set_title(
        f"cadence bench {record['kind']}{' --quick' if record['quick'] else ''}: "
        f"{record['machine']['cpu_count']} CPUs, load {load:.1f}, {record['created']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
