"""The end-of-run reports: to rank 0 alone, each rank's timeline bounded.

Specification:
- ``capped_timeline`` keeps the last steps' spans and at most ``max_events``
  communication events of a rank (the latest), and says how many it dropped;
- after a run, rank 0 holds every rank's timeline and the bounds it was cut to
  (steps per rank, events per rank, events dropped per rank); the other ranks
  hold no report at all (a launch ships every rank's return value to its parent);
- ``metrics.json`` records those bounds and the timeline picture's title says them,
  naming the ranks that dropped events.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cadence import EventLog
from cadence.testing import run_distributed
from cadence.train.config import TrainConfig
from cadence.train.history import RunHistory
from cadence.train.plots import TIMELINE_MAX_EVENTS, TIMELINE_STEPS, capped_timeline
from cadence.train.report import write_metrics
from cadence.train.run import _timeline_note
from tests.train.bodies_reports import body_reports

pytestmark = pytest.mark.one_lane  # [Note: one lane runs each end-to-end run of cadence train]


def _log(steps: int, per_step: int) -> EventLog:
    log = EventLog()
    for s in range(steps):
        log.mark("step", step=s)
        for i in range(per_step):
            log.record("all_reduce", "dp", torch.zeros(1), step=s, i=i)
        log.mark("step_end", step=s)
    return log


def test_capped_timeline_keeps_the_latest_events() -> None:
    events, dropped = capped_timeline(_log(5, 300), steps=3, max_events=100)
    assert [e[1] for e in events if e[0] == "step"] == ["2", "3", "4"]
    comms = [e for e in events if e[0] != "step"]
    assert len(comms) == 100 and dropped == 3 * 300 - 100
    log = _log(5, 300)
    newest = [e.issue_t for e in log.collectives()][-100:]
    kept, _ = capped_timeline(log, steps=3, max_events=100)
    assert [e[2] for e in kept if e[0] != "step"] == newest
    assert capped_timeline(_log(2, 4), steps=3, max_events=100)[1] == 0


def test_default_bounds() -> None:
    assert TIMELINE_STEPS == 3 and TIMELINE_MAX_EVENTS == 512


@pytest.mark.parametrize("flags", [{}, {"pp": 2}], ids=["dp", "pp2"])
def test_reports_reach_rank0_alone(flags: dict) -> None:
    results = run_distributed(body_reports, flags, world_size=2, timeout=180)
    first, other = results
    assert len(first["timeline"]) == 2
    for events in first["timeline"]:
        assert [e[0] for e in events].count("step") == TIMELINE_STEPS
        assert len([e for e in events if e[0] != "step"]) <= TIMELINE_MAX_EVENTS
        assert all(isinstance(e, tuple) and len(e) == 5 for e in events)
    assert first["timeline_bounds"] == {
        "steps_per_rank": TIMELINE_STEPS,
        "max_events_per_rank": TIMELINE_MAX_EVENTS,
        "dropped_events_per_rank": [0, 0],
    }
    assert other == {"timeline": None, "timeline_bounds": None}


def test_metrics_and_title_say_the_bounds(tmp_path: Path) -> None:
    bounds = {"steps_per_rank": 3, "max_events_per_rank": 512, "dropped_events_per_rank": [0, 7]}
    result = {"losses": [1.0], "history": RunHistory(), "collectives": {}}
    write_metrics(TrainConfig(), {}, {**result, "timeline_bounds": bounds}, tmp_path)
    assert json.loads((tmp_path / "metrics.json").read_text())["timeline_bounds"] == bounds
    note = _timeline_note(bounds)
    assert "last 3 steps per rank, at most 512 communication events each" in note
    assert "earlier events dropped: rank 1: 7" in note and "rank 0" not in note
