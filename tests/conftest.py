"""Shared pytest setup: tests import their rank bodies as ``tests.<area>._bodies``.

[Note: torch-free tests run once across torch lanes]
``./dev test`` runs the suite on every torch lane (docs/torch-versions.md). A test
module that needs no torch at all says so with ``pytestmark = pytest.mark.torch_free``
(or a list holding it). The first lane runs those modules in their own pytest process
with ``--torch-free=only``, where any import of torch raises: a module marked wrongly
fails there rather than passing silently on one lane only. Every lane then runs the
rest with ``--torch-free=skip``. Without the option, everything runs.

[Note: benchmark tests run on the primary lane only]
``cadence bench`` measures against the primary torch (docs/benchmarks.md shows only its
records; an earlier release's are history). A module marked ``primary_lane`` checks
that plumbing, or scripts around it, and runs on the primary lane only: ``./dev test``
sets ``CADENCE_TORCH_LANE`` and ``CADENCE_PRIMARY_LANE``, and another lane deselects
the module. Run by hand (no lane set), everything runs.

[Note: costly launcher tests run on the other lane only]
The primary lane is the longest and closest to CI's budget. A test marked
``other_lane`` exercises, at a cost of tens of seconds, what both lanes share: torchrun
agents as emulated nodes, world-4 variants of a path whose world-2 cases run on every
lane. ``./dev test`` runs it on the lanes other than the primary one (today 2.13), so
each CI run still runs it once; a run of the primary lane alone (``CADENCE_LANES=2.15``)
runs it there. Run by hand (no lane set), everything runs.

[Note: one lane runs each end-to-end run of cadence train]
A module marked ``one_lane`` runs ``cadence train`` end to end (the CLI under torchrun
or the launcher, or the train loop in launched ranks: checkpoints, resume, faults,
exports, user models) and costs tens of seconds a file: together about 350 s of the
1260 s a lane took on a slow 2-core machine before warm ranks. Everything such a run
drives (DataParallel, fully_shard, the pipeline runtime, the pickler) is tested on
every lane in its own folder, so a torch release that breaks a layer fails there; so
are the checkpoint's integrity checks (hostile files) and ``--compile``, whose torch
APIs move. Each test of such a module runs on one lane of the run
(``CADENCE_RUN_LANES``, which ``./dev test`` sets): the lane at the CRC-32 of its node
id modulo the number of lanes.
The choice is stable from run to run, spreads a module's tests (and the variants of
one test) over the lanes, and halves the cost per lane with two; a run of one lane,
or by hand, runs them all. The cheap unit tests of such a module are split too: a
mark per module keeps the rule visible where the tests are.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class _NoTorch:
    """A meta-path finder under which ``import torch`` (and any submodule) fails."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "torch" or name.startswith("torch."):
            raise ImportError(
                f"{name}: this test module is marked torch_free (--torch-free=only), "
                "so it may not import torch; drop the mark if it needs torch"
            )
        return None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--torch-free",
        choices=("only", "skip"),
        default=None,
        help="only: run just the modules marked torch_free, with torch unimportable; "
        "skip: run everything else (see [Note: torch-free tests run once across torch lanes])",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "torch_free: the module needs no torch; run once, not on every torch lane"
    )
    config.addinivalue_line(
        "markers",
        "primary_lane: checks the benchmarks, which measure against the primary torch; "
        "other lanes skip it",
    )
    config.addinivalue_line(
        "markers",
        "other_lane: costly and alike on every lane; the primary lane skips it (budget)",
    )
    config.addinivalue_line(
        "markers",
        "one_lane: an end-to-end run of cadence train; one lane of the run runs it (budget)",
    )
    if config.getoption("--torch-free") == "only":
        if any(m == "torch" or m.startswith("torch.") for m in sys.modules):
            raise pytest.UsageError("--torch-free=only: torch was imported before the tests")
        sys.meta_path.insert(0, _NoTorch())


def _declares_torch_free(path: Path) -> bool:
    return "pytest.mark.torch_free" in path.read_text(encoding="utf-8")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # Under --torch-free=only a module (or a folder's conftest.py) that imports torch
    # would fail to import, so only modules that declare the mark in their source, and
    # the folders holding them, are collected at all.
    if config.getoption("--torch-free") != "only":
        return None
    if collection_path.is_dir():
        return not any(_declares_torch_free(p) for p in collection_path.rglob("test_*.py"))
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return not _declares_torch_free(collection_path)
    return None


def _lanes() -> tuple[str | None, str | None, list[str]]:
    """(this lane, the primary lane, every lane of this ``./dev test`` run); Nones and
    an empty list when run by hand."""
    lane, primary = os.environ.get("CADENCE_TORCH_LANE"), os.environ.get("CADENCE_PRIMARY_LANE")
    run = os.environ.get("CADENCE_RUN_LANES", "").split()
    return lane, primary, run


def _other_lane() -> bool:
    """Whether ``./dev test`` runs this session on a lane other than the primary one."""
    lane, primary, _ = _lanes()
    return lane is not None and primary is not None and lane != primary


def lane_keeps(markers: set[str], nodeid: str) -> bool:
    """Whether this lane runs a test with these marker names: [Note: benchmark tests run
    on the primary lane only], [Note: costly launcher tests run on the other lane only]
    and [Note: one lane runs each end-to-end run of cadence train]."""
    lane, primary, run = _lanes()
    if lane is None or primary is None:
        return True  # run by hand: everything runs
    if "primary_lane" in markers and lane != primary:
        return False
    if "other_lane" in markers:  # it decides over one_lane (a module's mark)
        # The primary takes it only where this run's lanes are known to hold no other.
        return lane != primary or (bool(run) and all(x == primary for x in run))
    if "one_lane" in markers and lane in run:
        return run[zlib.crc32(nodeid.encode()) % len(run)] == lane
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mode = config.getoption("--torch-free")
    selected = items
    if mode is not None:
        keep = mode == "only"
        selected = [i for i in selected if (i.get_closest_marker("torch_free") is not None) == keep]
    selected = [i for i in selected if lane_keeps({m.name for m in i.iter_markers()}, i.nodeid)]
    if len(selected) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in selected])
        items[:] = selected


# [Note: the suite's time per file]
# Each lane must stay well under CI's budget (docs/torch-versions.md), and a test
# file that grows slow should be seen before it is felt. So every run sums each
# file's setup, call and teardown time, prints the slowest files with the total,
# and, when CADENCE_TEST_TIMES names a file (``./dev test`` sets one per lane, under
# the git-ignored .test-times/), writes every file's seconds there as JSON. Nothing
# asserts on these times: they are a record, read on a quiet machine.
_FILE_SECONDS: dict[str, float] = {}
SLOWEST_SHOWN = 10


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not _FILE_SECONDS:
        return
    ranked = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("-", f"time per test file: {total:.0f} s in {len(ranked)} files")
    for path, seconds in ranked[:SLOWEST_SHOWN]:
        terminalreporter.write_line(f"{seconds:7.1f} s  {path}")
    target = os.environ.get("CADENCE_TEST_TIMES")
    if target:
        out = Path(target)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {"total_s": round(total, 2), "files": {p: round(s, 2) for p, s in ranked}}
        out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
