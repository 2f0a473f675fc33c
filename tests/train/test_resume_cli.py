"""``cadence train --resume`` from the command line: what is loaded and what is skipped.

Specification:
- resume takes the newest *complete* checkpoint: a folder without its manifest (a
  save cut short), a folder whose files do not match the manifest (corrupt) and an
  unfinished ``.tmp`` save are skipped, and the skip is reported;
- the resumed run's ``metrics.json`` holds the whole curve from step 1, equal to
  the first run's; the stale ``.tmp`` folder is deleted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadence.cli import main

pytestmark = pytest.mark.one_lane  # [Note: one lane runs each end-to-end run of cadence train]

SMALL = ["--nproc", "2", "--batch-size", "8", "--d-model", "16", "--layers", "2"]


def test_partial_and_corrupt_checkpoints_are_skipped(tmp_path: Path, capfd) -> None:
    run = tmp_path / "run"
    flags = [*SMALL, "--steps", "6", "--checkpoint-every", "2", "--run-dir", str(run)]
    assert main(["train", *flags]) == 0
    first = json.loads((run / "metrics.json").read_text())["losses"]
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-2", "step-4", "step-6"]
    # step-6: a data file cut short; step-4: no manifest; and a save that never finished.
    data = next((ckpts / "step-6").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-10])
    (ckpts / "step-4" / "cadence.json").unlink()
    (ckpts / ".step-8.tmp").mkdir()
    capfd.readouterr()
    assert main(["train", *flags, "--resume"]) == 0
    err = capfd.readouterr().err
    assert "resumed from step-2 (step 2)" in err
    assert ".step-8.tmp: an unfinished save" in err
    assert "step-6: __" in err and "the manifest says" in err
    assert "step-4: no cadence.json (its save did not finish)" in err
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["losses"] == first and len(first) == 6
    assert not (ckpts / ".step-8.tmp").exists()
    # the resumed run wrote complete checkpoints over the bad ones
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-2", "step-4", "step-6"]
    assert "step-6: __" not in capfd.readouterr().err
