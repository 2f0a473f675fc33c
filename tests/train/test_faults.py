"""Lost and hung ranks: the job stops with an error naming the rank, and a restart
with ``--resume`` continues the same curve.

Specification:
- under ``torchrun --max-restarts 1``, a worker SIGKILLed mid-run is restarted with
  the others and the job finishes with exactly the loss curve of a run nobody killed
  (``cadence.init`` scopes its store to the restart attempt, so the new workers
  never read the dead attempt's addresses);
- under cadence's own launcher, a SIGKILLed rank stops every rank, the error names
  it, and relaunching with ``--resume`` continues the same curve;
- a collective whose peer stopped answering ends the rank after
  ``--collective-timeout`` with an error naming the rank, the step, the collective and
  the peer that never reported the same timeout (the one that stopped answering).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cadence.cli import main
from cadence.launch import LaunchError, launch
from tests.train.bodies_checkpoint import BASE, body_faulty

pytestmark = pytest.mark.one_lane  # [Note: one lane runs each end-to-end run of cadence train]

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--batch-size", "8", "--d-model", "16", "--layers", "2"]


def test_torchrun_restarts_a_killed_worker_and_the_curve_is_unchanged(tmp_path: Path) -> None:
    flags = [*SMALL, "--steps", "10", "--checkpoint-every", "5", "--resume"]
    env = dict(os.environ, CADENCE_TEST_KILL_AT="8", CADENCE_TEST_KILL_RANK="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(ROOT / "tests" / "train" / "torchrun_kill.py"),
        "train",
        *flags,
        "--run-dir",
        str(tmp_path / "killed"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr  # the kill happened, torchrun saw it
    assert "resumed from step-5 (step 5)" in proc.stderr
    killed = json.loads((tmp_path / "killed" / "metrics.json").read_text())
    assert main(["train", *flags, "--nproc", "2", "--run-dir", str(tmp_path / "clean")]) == 0
    clean = json.loads((tmp_path / "clean" / "metrics.json").read_text())
    assert killed["losses"] == clean["losses"] and len(clean["losses"]) == 10
    assert killed["resumes"] == [5] and clean["resumes"] == []


def test_launcher_names_a_killed_rank_and_a_relaunch_resumes(tmp_path: Path) -> None:
    cfg = dataclasses.replace(
        BASE, steps=6, checkpoint_every=2, resume=True, run_dir=str(tmp_path / "run")
    )
    ref = dataclasses.replace(BASE, steps=6, run_dir=str(tmp_path / "ref"))
    with pytest.raises(LaunchError, match=r"rank 1 exited with code -9 .*killed by signal 9"):
        launch(body_faulty, cfg, "kill", 5, 1, nprocs=2, timeout=120, init_process_group=False)
    (again,) = launch(body_faulty, cfg, "none", 0, 0, nprocs=2, init_process_group=False)[:1]
    (clean,) = launch(body_faulty, ref, "none", 0, 0, nprocs=2, init_process_group=False)[:1]
    assert again["history"].resumes == [4]
    assert again["losses"] == clean["losses"] and len(again["losses"]) == 6


def test_a_hung_collective_names_the_rank_and_the_collective() -> None:
    cfg = dataclasses.replace(BASE, steps=4, collective_timeout=3.0)
    with pytest.raises(LaunchError) as info:
        launch(body_faulty, cfg, "stall", 2, 1, nprocs=2, timeout=120, init_process_group=False)
    message = str(info.value)
    assert "rank 0 raised CollectiveTimeoutError: rank 0 timed out in step 2" in message
    assert "all_reduce on group" in message and "--collective-timeout" in message
    # The stalled rank is named: it never reported the timeout the others hit.
    assert "rank(s) [1] had not reported a timeout 2 s later" in message, message
