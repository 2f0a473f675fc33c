"""``cadence train --data`` end to end, at tiny sizes.

Specification:
- ``cadence train --data stdlib --steps 3`` (world 2) trains byte-level on the
  standard library's source: the model gets 256 ids, the first loss is near ln 256,
  the held-out loss of each ``--eval-every`` lands in ``metrics.json`` (``evals``:
  ``[step, loss]``, and the summary's ``last_eval_loss``), ``config.toml`` records the
  data options and replays them;
- on a generated uint16 shard under dp 2, a run lost before step 5 and resumed from
  its step-3 checkpoint logs bit for bit the losses and held-out losses of the run
  that was never interrupted (the batch of step N is a function of (seed, N));
- a pipeline (pp 2) evaluates the same held-out loss as data parallelism.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from cadence.cli import main
from cadence.testing import run_distributed
from cadence.train.config import TrainConfig
from cadence.train.config_file import read_config_file
from tests.train.bodies_checkpoint import body_resume
from tests.train.test_data import write_nanogpt

pytestmark = pytest.mark.one_lane  # [Note: one lane runs each end-to-end run of cadence train]

SMALL = ["--nproc", "2", "--batch-size", "8", "--d-model", "16", "--layers", "2"]


def test_stdlib_trains_and_evaluates(tmp_path: Path, capfd) -> None:
    run = tmp_path / "run"
    argv = ["train", "--data", "stdlib", "--steps", "3", *SMALL, "--run-dir", str(run)]
    assert main([*argv, "--eval-every", "2", "--eval-batches", "1"]) == 0
    err = capfd.readouterr().err
    assert "files of the Python standard library, byte-level" in err and "held out" in err
    metrics = json.loads((run / "metrics.json").read_text())
    losses = metrics["losses"]
    assert len(losses) == 3 and abs(losses[0] - math.log(256)) < 0.6
    assert [s for s, _ in metrics["evals"]] == [2, 3]  # every 2nd step, and the last
    assert metrics["summary"]["last_eval_loss"] == metrics["evals"][-1][1]
    replay = TrainConfig(**read_config_file(run / "config.toml"))
    assert (replay.data, replay.eval_every, replay.model.vocab_size) == ("stdlib", 2, 256)


def test_a_resumed_shard_run_matches_the_unbroken_one(tmp_path: Path) -> None:
    # Ids below the test model's 64, with structure to learn: a repeating ramp.
    shard = write_nanogpt(tmp_path / "train.bin", (np.arange(40_000) * 7) % 61)
    flags = {"data": str(shard), "eval_every": 2, "eval_batches": 1}
    results = run_distributed(body_resume, flags, str(tmp_path), 3, 5, world_size=2, timeout=150)
    for r in results:
        assert r["resumed"] == r["full"] and len(r["full"]) == 8
        assert r["history"].resumes == [3]
        assert r["history"].evals == r["full_history"].evals
        assert [s for s, _ in r["history"].evals] == [2, 4, 6, 8]
    assert results[0]["full"] == results[1]["full"]


def test_a_pipeline_evaluates_as_data_parallel(tmp_path: Path) -> None:
    evals = []
    for extra in ([], ["--pp", "2"]):
        run = tmp_path / f"run{len(evals)}"
        argv = ["train", "--data", "stdlib", "--steps", "2", *SMALL, *extra]
        assert main([*argv, "--eval-every", "2", "--run-dir", str(run)]) == 0
        evals.append(json.loads((run / "metrics.json").read_text())["evals"])
    assert abs(evals[0][0][1] - evals[1][0][1]) < 1e-4
