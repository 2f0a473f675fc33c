"""The supported torch range, the CI lanes and the pins say the same thing.

torch 2.15 is the primary target (constraints.txt, `./dev train`, the benchmarks page)
and 2.13 the oldest supported release (constraints-torch2.13.txt); pyproject.toml
declares the range between them, and the suite runs on whichever lane's venv runs it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from cadence.bench.report import PRIMARY_TORCH

ROOT = Path(__file__).resolve().parents[1]


def _torch_pin(path: Path) -> str:
    pins = [m.group(1) for m in re.finditer(r"^torch==(\S+)$", path.read_text(), re.M)]
    assert len(pins) == 1, f"{path.name} must pin torch exactly once, found {pins}"
    return pins[0]


def _release(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def test_the_primary_lane_pins_the_release_the_benchmarks_page_shows() -> None:
    assert _release(_torch_pin(ROOT / "constraints.txt")) == PRIMARY_TORCH == "2.15"


def test_the_declared_range_spans_exactly_the_tested_lanes() -> None:
    oldest = _release(_torch_pin(ROOT / "constraints-torch2.13.txt"))
    declared = re.search(r'"torch>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert declared is not None, "pyproject.toml must declare torch>=OLDEST,<NEXT"
    low, high = declared.groups()
    assert low == oldest == "2.13"
    major, minor = PRIMARY_TORCH.split(".")
    assert high == f"{major}.{int(minor) + 1}", "the upper bound admits the primary release"


def test_the_oldest_lane_differs_from_the_primary_only_in_torch() -> None:
    # ./dev builds the oldest lane's pins from constraints.txt with the torch line
    # replaced, so a lane file that pinned anything else would be ignored silently.
    lines = [
        line
        for line in (ROOT / "constraints-torch2.13.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines == ["torch==2.13.0"]


def test_this_run_is_on_a_supported_torch() -> None:
    assert _release(torch.__version__) in {"2.13", "2.14", "2.15"}, torch.__version__


def test_a_lane_runs_the_torch_it_names() -> None:
    # ./dev test sets CADENCE_TORCH_LANE for each lane: a venv that drifted from its
    # pins (a reused .venv, a site-wide pip cap) would otherwise pass as the other lane.
    lane = os.environ.get("CADENCE_TORCH_LANE")
    if lane is None:
        pytest.skip("not run through ./dev test (no CADENCE_TORCH_LANE)")
    assert _release(torch.__version__) == lane, (torch.__version__, lane)


def _set_lanes(monkeypatch: pytest.MonkeyPatch, lane: str | None, run: str | None) -> None:
    values = {
        "CADENCE_TORCH_LANE": lane,
        "CADENCE_PRIMARY_LANE": None if lane is None else PRIMARY_TORCH,
        "CADENCE_RUN_LANES": run,
    }
    for name, value in values.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


def test_only_the_primary_lane_runs_the_benchmark_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """See [Note: benchmark tests run on the primary lane only] in tests/conftest.py."""
    from tests.conftest import _other_lane

    dev = (ROOT / "dev").read_text()
    assert "CADENCE_PRIMARY_LANE=$PRIMARY" in dev and f"PRIMARY={PRIMARY_TORCH}\n" in dev
    for lane, other in [(None, False), (PRIMARY_TORCH, False), ("2.13", True)]:
        _set_lanes(monkeypatch, lane, None)  # lane None: run by hand, everything runs
        assert _other_lane() is other, lane


def test_each_one_lane_test_runs_on_exactly_one_lane_of_a_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """See [Note: one lane runs each end-to-end run of cadence train] in tests/conftest.py."""
    from tests.conftest import lane_keeps

    dev = (ROOT / "dev").read_text()
    assert 'CADENCE_RUN_LANES="$lanes"' in dev
    run = f"{PRIMARY_TORCH} 2.13"
    ids = [f"tests/train/test_x.py::test_{i}[v{i % 3}]" for i in range(200)]
    kept: dict[str, set[str]] = {}
    for lane in run.split():
        _set_lanes(monkeypatch, lane, run)
        kept[lane] = {n for n in ids if lane_keeps({"one_lane"}, n)}
        assert all(lane_keeps(set(), n) for n in ids)  # unmarked: every lane
    assert kept[PRIMARY_TORCH].isdisjoint(kept["2.13"])
    assert kept[PRIMARY_TORCH] | kept["2.13"] == set(ids)
    assert 60 < len(kept[PRIMARY_TORCH]) < 140, len(kept[PRIMARY_TORCH])  # spread, not lumped
    for lane, alone in ((PRIMARY_TORCH, PRIMARY_TORCH), ("2.13", "2.13"), (None, None)):
        _set_lanes(monkeypatch, lane, alone)  # one lane, or by hand: all of them
        assert all(lane_keeps({"one_lane"}, n) for n in ids), (lane, alone)


def test_other_lane_tests_run_once_in_every_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """See [Note: costly launcher tests run on the other lane only]: on the other lane
    when the run has one, else on the primary; a module's one_lane mark does not
    override it."""
    from tests.conftest import lane_keeps

    run = f"{PRIMARY_TORCH} 2.13"
    for marks in ({"other_lane"}, {"other_lane", "one_lane"}):
        _set_lanes(monkeypatch, PRIMARY_TORCH, run)
        assert not lane_keeps(marks, "t::a")
        _set_lanes(monkeypatch, "2.13", run)
        assert lane_keeps(marks, "t::a")
        _set_lanes(monkeypatch, PRIMARY_TORCH, PRIMARY_TORCH)
        assert lane_keeps(marks, "t::a")
