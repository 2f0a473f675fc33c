"""Checkpoint and resume: an interrupted and resumed run trains bit-identically.

Specification:
- ``--checkpoint-every K --resume``: a run lost before step ``s`` and started again
  with the same command continues from the newest complete checkpoint and logs
  exactly (bit for bit) the loss curve of the run that was never interrupted, for
  DataParallel, fully_shard and a pipeline; the history holds every step from 1;
- checkpoints land in ``<run-dir>/checkpoints/step-<N>/``, one per K steps and one
  after the last step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.launch import LaunchError
from cadence.testing import run_distributed
from tests.train.bodies_checkpoint import body_resume, body_rng_round_trip, body_train

pytestmark = pytest.mark.one_lane  # [Note: one lane runs each end-to-end run of cadence train]


@pytest.mark.parametrize(
    "flags",
    [{}, {"fsdp": True}, {"pp": 2}],
    ids=["dp", "fsdp", "pp2"],
)
def test_resume_is_bit_identical(tmp_path: Path, flags: dict) -> None:
    results = run_distributed(body_resume, flags, str(tmp_path), 3, 5, world_size=2, timeout=150)
    for r in results:
        assert r["resumed"] == r["full"] and len(r["full"]) == 8
        assert r["on_disk"] == ["step-3"]  # lost before step 5: only step 3 was complete
        assert r["history"].resumes == [3]
        assert r["history"].checkpoints == [3, 6, 8]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [{"pp": 2}, {"pp": 2, "fsdp": True}],
    ids=["pp2xdp2", "pp2xfsdp2"],
)
def test_resume_is_bit_identical_pp_times_dp(tmp_path: Path, flags: dict) -> None:
    results = run_distributed(body_resume, flags, str(tmp_path), 3, 5, world_size=4, timeout=200)
    for r in results:
        assert r["resumed"] == r["full"] and len(r["full"]) == 8


def test_async_checkpoint_resume_is_bit_identical(tmp_path: Path) -> None:
    saving = {"async_checkpoint": True, "keep": 1}
    results = run_distributed(
        body_resume, {}, str(tmp_path), 3, 5, saving, world_size=2, timeout=150
    )
    for r in results:
        assert r["resumed"] == r["full"]
        assert r["history"].resumes == [3]  # the restart found the step-3 save
        assert r["history"].checkpoints == [3, 6, 8]
    # --keep 1: only the last checkpoint is left
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-8"]


def test_rng_states_are_restored_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(body_rng_round_trip, str(tmp_path), world_size=2, timeout=120)
    for r in results:
        assert r["same_torch"] and r["same_python"]
    assert results[0]["draw"] != results[1]["draw"]  # each rank got its own stream back


@pytest.mark.slow
def test_fsdp_resumes_on_another_world_size(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    ref = run_distributed(body_train, {"fsdp": True}, str(tmp_path / "ref"), world_size=2)
    half = {"fsdp": True, "steps": 4, "checkpoint_every": 4, "resume": True}
    run_distributed(body_train, half, run, world_size=2, timeout=120)
    more = {"fsdp": True, "checkpoint_every": 4, "resume": True}
    four = run_distributed(body_train, more, run, world_size=4, timeout=150)
    full = ref[0]["losses"]
    for r in four:
        assert r["history"].resumes == [4]
        assert r["losses"][:4] == full[:4]  # the saved curve
        # resharded state: the same training, up to float rounding of another world
        assert max(abs(a - b) for a, b in zip(r["losses"], full)) < 1e-4


def test_another_world_size_without_fsdp_and_other_settings_are_refused(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    run_distributed(body_train, {"steps": 2, "checkpoint_every": 2}, run, world_size=2)
    with pytest.raises(LaunchError, match="saved by 2 ranks and this run has 1: only --fsdp"):
        run_distributed(body_train, {"resume": True}, run, world_size=1)
    with pytest.raises(LaunchError, match=r"other settings \(lr: saved 0.003, now 0.1\)"):
        run_distributed(body_train, {"resume": True, "lr": 0.1}, run, world_size=2)


SCHEDULED = {"warmup_steps": 2, "lr_schedule": "cosine", "min_lr": 1e-4, "clip_grad_norm": 0.3}


@pytest.mark.parametrize(
    "flags",
    [SCHEDULED, {**SCHEDULED, "pp": 2}],
    ids=["dp", "pp2"],
)
def test_resume_with_schedule_and_clipping_is_bit_identical(tmp_path: Path, flags: dict) -> None:
    """Warmup, cosine decay and clipping on: the resumed run's losses are the unbroken
    run's, bit for bit, and the checkpoint holds the schedule's state."""
    from torch.distributed.checkpoint import FileSystemReader

    results = run_distributed(body_resume, flags, str(tmp_path), 3, 5, world_size=2, timeout=150)
    for r in results:
        assert r["resumed"] == r["full"] and len(r["full"]) == 8
        assert r["history"].resumes == [3]
    saved = FileSystemReader(str(tmp_path / "cut" / "checkpoints" / "step-3")).read_metadata()
    key = "lr_schedule/optim_pp0" if flags.get("pp") else "lr_schedule/optim"
    assert {f"{key}/last_epoch", f"{key}/base_lrs"} <= set(saved.state_dict_metadata)
