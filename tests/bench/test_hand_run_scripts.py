"""The hand-run scripts in the repository's ``bench/`` still run.

They are not part of ``cadence bench`` and nothing else calls them, so without this
they would rot unseen as the library changes. Each runs once at a tiny size, in its
own process as a person would run it, and must finish and print its table. Nothing
is asserted on a figure. ``bench/bench_precompile.py`` is left out: it only adds knobs
to `cadence.bench.precompile`, which the plumbing test runs, and its smallest run
compiles for minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Benchmarks measure against the primary torch: see [Note: benchmark tests run on the
# primary lane only] in tests/conftest.py.
pytestmark = pytest.mark.primary_lane

REPO = Path(__file__).resolve().parents[2]

# script -> (tiny arguments, a line its output must contain)
SCRIPTS: dict[str, tuple[list[str], str]] = {
    "bench_dp.py": (
        ["--reps", "2", "--warmup", "1", "--layers", "2", "--width", "64", "--batch", "8"],
        "step-time ratio manual / auto",
    ),
    "bench_fsdp.py": (
        ["--reps", "2", "--warmup", "1", "--dim", "64", "--layers", "2", "--batch", "4"],
        "step time, median ms",
    ),
    "bench_pickling.py": (["--repeat", "1", "--size-mb", "1"], "torch tensor (protocol 5, oob)"),
    "bench_pipeline.py": (
        [
            "--steps",
            "1",
            "--warmup",
            "1",
            "--d-model",
            "16",
            "--layers",
            "4",
            "--batch",
            "8",
            "--seq",
            "8",
            "--only",
            "1f1b",
        ],
        "1f1b v=1",
    ),
    "bench_pp_batched_p2p.py": (
        ["--steps", "1", "--warmup", "1", "--d-model", "16"],
        "per_directed_edge",
    ),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_hand_run_script_runs_at_a_tiny_size(script: str) -> None:
    args, expected = SCRIPTS[script]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert expected in done.stdout, done.stdout[-2000:]
