"""``cadence bench step --link calibrated --launches N``: one row from N launches of a case.

[Note: launches, not only repetitions]
A run's repetitions are interleaved, so the machine's noise of the moment hits every
variant alike, and the quartiles say how far one repetition strays. They say nothing
of what a launch fixes for all its repetitions: where the allocator put the buffers,
which core each rank and gloo thread landed on, what the machine was doing in those
minutes. On the emulated link that is the larger part of the noise. Two records of
the same code read the pipeline's overlap efficiency as 0.94 and 0.76, nanoGPT's as
0.67 and 0.61, each from 40 repetitions whose quartiles were tight: on a room of
0.14 C the efficiency moves by 0.1-0.2 from launch to launch.

So a case can run in N launches, each on a fresh link with fresh ranks, and its row is
the median over launches of every figure the launches measured: the ratio summaries
(median, quartiles and range each the median of the launches' own), the times, the
CPU, the bytes, the bounds' inputs. The overlap efficiency is the exception: a ratio
of two differences, it is computed in each launch from that launch's own figures
(its compute alone, serial time and bound), and the row's is the median of those, as
is the cores' limit on it; the verdicts read those medians. Every launch's ratios and
link figures are kept in the row (``launches``) and the report prints each launch's,
so a median never hides a launch that disagrees. The traced step and the losses
come from one launch, the one whose cadence / torch ratio is the median's (the lower
middle for an even N): a trace is one step, not a statistic.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Sequence
from typing import Any

from cadence.errors import CadenceValueError

__all__ = ["MAX_LAUNCHES", "check_launches", "combine_launches", "launch_summary"]

MAX_LAUNCHES = 9  # a full calibrated run is about 20 minutes per launch

# Kept from the representative launch, never combined: one traced step, the losses
# (every launch runs the same seeded steps on the same batch), and what names the run.
_FROM_ONE = ("trace", "losses", "timeline", "_timeline_src", "case", "what", "metric", "rate")


def check_launches(launches: int, *, calibrated: bool) -> None:
    """Refuse a launch count the run cannot honour, before any link is made."""
    if not calibrated and launches != 1:
        raise CadenceValueError(
            "--launches applies to 'cadence bench step --link calibrated' only; drop "
            "--launches, or add --link calibrated"
        )
    if not 1 <= launches <= MAX_LAUNCHES:
        raise CadenceValueError(
            f"--launches {launches}: give 1 to {MAX_LAUNCHES} (each launch repeats every "
            "case at both rates, about 20 minutes for all cases)"
        )


def launch_summary(row: dict[str, Any]) -> dict[str, Any]:
    """One launch's own figures, kept beside the combined row: its ratios and its link
    figures, from which the report computes that launch's efficiencies."""
    best = row.get("ratio_best")
    return {
        "ratio": row["ratio"]["median"],
        "ratio_best": best["median"] if best else None,
        "aa": row["aa"]["median"] if row.get("aa") else None,
        "load": row.get("load"),
        "link": copy.deepcopy(row.get("link")),
    }


def _median(values: Sequence[Any]) -> Any:
    """The median of one figure over launches, following the first launch's shape."""
    first = values[0]
    if isinstance(first, bool) or first is None or isinstance(first, str):
        return first
    if isinstance(first, (int, float)):
        nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(nums) != len(values):
            return first  # a figure some launch lacks: not a statistic
        m = statistics.median(nums)
        return int(m) if isinstance(first, int) and float(m).is_integer() else m
    if isinstance(first, dict):
        keys = [k for k in first if all(isinstance(v, dict) and k in v for v in values)]
        return {k: _median([v[k] for v in values]) for k in keys}
    if isinstance(first, list):
        if all(isinstance(v, list) and len(v) == len(first) for v in values):
            return [_median([v[i] for v in values]) for i in range(len(first))]
        return first
    return first


def combine_launches(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row from the same case's rows in several launches (see [Note: launches, not
    only repetitions])."""
    if not rows:
        raise ValueError("combine_launches() needs at least one launch's row")
    names = {(r["case"], r.get("rate")) for r in rows}
    if len(names) != 1:
        raise ValueError(f"combine_launches(): rows of different cases or rates: {sorted(names)}")
    if len(rows) == 1:
        return {**rows[0], "launches": [launch_summary(rows[0])]}
    order = sorted(range(len(rows)), key=lambda i: rows[i]["ratio"]["median"])
    middle = rows[order[(len(rows) - 1) // 2]]
    combined: dict[str, Any] = {}
    for key, value in middle.items():
        if key in _FROM_ONE:
            combined[key] = value
        elif all(key in r for r in rows):
            combined[key] = _median([r[key] for r in rows])
        else:
            combined[key] = value
    combined["launches"] = [launch_summary(r) for r in rows]
    combined["traced_launch"] = order[(len(rows) - 1) // 2]
    return combined
