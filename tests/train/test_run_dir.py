"""A run folder that already holds checkpoints: refused, overwritten on request, pruned by lineage.

Specification:
- a fresh run (no ``--resume``) into a ``--run-dir`` that holds checkpoints is refused
  before any rank starts, with one line naming the folder, the newest step and the
  two fixes (``--resume``, ``--overwrite``); the old checkpoints are left untouched;
- ``--overwrite`` deletes the old checkpoints at start and the new run starts over,
  with a lineage of its own;
- ``--keep`` counts only this run's lineage: a checkpoint of another run (another
  lineage id, or none: written before lineage ids) is never deleted;
- a folder is a checkpoint only if its whole name is ``step-<N>`` with N in ASCII
  digits: ``step-`` with Arabic-Indic digits and ``step-50\\n`` (a trailing newline)
  are ignored and reported as skipped;
- ``--resume --steps N`` below the checkpoint's step is refused before training,
  naming both numbers and the fix.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from cadence.cli import main
from cadence.train._errors import TrainConfigError
from cadence.train.checkpoint import ResumeRefusedError, find_latest

pytestmark = pytest.mark.one_lane  # [Note: one lane runs each end-to-end run of cadence train]

SMALL = ["--nproc", "2", "--batch-size", "8", "--d-model", "16", "--layers", "2"]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An earlier run's folder: 4 steps, checkpoints step-2 and step-4. Tests copy it."""
    run = tmp_path_factory.mktemp("a") / "run"
    flags = [*SMALL, "--steps", "4", "--checkpoint-every", "2", "--run-dir", str(run)]
    assert main(["train", *flags]) == 0
    return run


def _copy(run_a: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(run_a, run)
    return run


def _names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def _manifest(run: Path, name: str) -> dict:
    return json.loads((run / "checkpoints" / name / "cadence.json").read_text())


def test_a_fresh_run_into_a_run_dir_with_checkpoints_is_refused(run_a: Path, tmp_path: Path):
    run = _copy(run_a, tmp_path)
    before = {n: _manifest(run, n) for n in _names(run)}
    flags = [*SMALL, "--steps", "2", "--checkpoint-every", "1", "--keep", "1"]
    with pytest.raises(TrainConfigError) as info:  # --debug: raise, not one line
        main(["train", *flags, "--run-dir", str(run), "--debug"])
    message = str(info.value)
    assert "\n" not in message
    assert str(run) in message and "step-4" in message
    assert "--resume" in message and "--overwrite" in message
    # nothing ran: the earlier run's checkpoints and metrics are as they were
    assert {n: _manifest(run, n) for n in _names(run)} == before
    assert len(json.loads((run / "metrics.json").read_text())["losses"]) == 4


def test_overwrite_deletes_the_old_checkpoints_and_starts_over(
    run_a: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = _copy(run_a, tmp_path)
    old = _manifest(run, "step-4").get("lineage")
    flags = [*SMALL, "--steps", "2", "--checkpoint-every", "1", "--keep", "1", "--overwrite"]
    # The message is a record of the cadence.train logger (pytest's handlers receive
    # it here; a bare command line shows it on stderr: tests/train/test_log.py).
    caplog.set_level(logging.INFO, logger="cadence.train")
    assert main(["train", *flags, "--run-dir", str(run)]) == 0
    said = " ".join(caplog.messages)
    assert "deleted the checkpoints of an earlier run (step-2, step-4)" in said, said
    assert _names(run) == ["step-2"]  # --keep 1 of the new run
    new = _manifest(run, "step-2")
    assert new["lineage"] and new["lineage"] != old
    metrics = json.loads((run / "metrics.json").read_text())
    assert len(metrics["losses"]) == 2 and metrics["resumes"] == []


@pytest.mark.parametrize("foreign", ["another-run", None], ids=["other-lineage", "no-lineage"])
def test_keep_prunes_only_this_runs_lineage(
    run_a: Path, tmp_path: Path, foreign: str | None
) -> None:
    run = _copy(run_a, tmp_path)
    # step-2 stands for a checkpoint of another run (copied in, or written by a
    # cadence without lineage ids); the resumed run continues step-4's lineage.
    path = run / "checkpoints" / "step-2" / "cadence.json"
    manifest = json.loads(path.read_text())
    manifest.pop("lineage", None)
    if foreign is not None:
        manifest["lineage"] = foreign
    path.write_text(json.dumps(manifest))
    flags = [*SMALL, "--steps", "6", "--checkpoint-every", "2", "--keep", "1", "--resume"]
    assert main(["train", *flags, "--run-dir", str(run)]) == 0
    assert _names(run) == ["step-2", "step-6"]  # step-4 pruned, the other run's kept
    assert _manifest(run, "step-6")["lineage"] == _manifest(run_a, "step-4")["lineage"]


def test_step_names_are_ascii_digits_only(run_a: Path, tmp_path: Path) -> None:
    run = _copy(run_a, tmp_path)
    ckpts = run / "checkpoints"
    # Complete checkpoints under names that only look like step numbers: "\d" matches
    # Arabic-Indic digits, and "$" matches before a trailing newline.
    for name in ("step-\u0669\u0669", "step-50\n", "step-+7", "step-07"):
        shutil.copytree(ckpts / "step-2", ckpts / name)
    folder, skipped = find_latest(run)
    assert folder == ckpts / "step-4"
    for name in ("step-\u0669\u0669", "step-50\n", "step-+7", "step-07"):
        assert any(line.startswith(f"{name!r}: not a checkpoint name") for line in skipped), (
            name,
            skipped,
        )


def test_a_run_dir_with_only_misnamed_folders_is_not_refused(tmp_path: Path) -> None:
    from cadence.train.checkpoint import check_run_dir
    from cadence.train.config import TrainConfig

    run = tmp_path / "run"
    (run / "checkpoints" / "step-\u0669\u0669").mkdir(parents=True)
    check_run_dir(TrainConfig(run_dir=str(run), checkpoint_every=1))  # no error


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused(run_a: Path, tmp_path: Path):
    run = _copy(run_a, tmp_path)
    flags = [*SMALL, "--steps", "2", "--checkpoint-every", "2", "--resume"]
    with pytest.raises(ResumeRefusedError) as info:  # --debug: raise, not one line
        main(["train", *flags, "--run-dir", str(run), "--debug"])
    message = str(info.value)
    assert "\n" not in message
    assert "--steps is 2" in message and "step 4" in message
    assert "pass --steps above 4" in message
    assert _names(run) == ["step-2", "step-4"]
