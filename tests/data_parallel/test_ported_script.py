"""The single-file GPT script of ``examples/train_gpt.py`` under four wrappers at world 2.

Only the wrapping line differs. cadence.DataParallel must give torch DDP's losses and
one all-reduce per optimizer step (the script accumulates with
``require_backward_grad_sync``); cadence.fully_shard must give torch FSDP2's losses and
the same all-gather / reduce-scatter counts; all four agree within 1e-5 relative.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from cadence.testing import run_distributed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run_all(out_dir: str) -> dict[str, Any]:
    sys.path.insert(0, str(EXAMPLES))
    import train_gpt

    return {
        w: train_gpt.main(["--wrapper", w, "--count-collectives", "--out-dir", f"{out_dir}/{w}"])
        for w in train_gpt.WRAPPERS
    }


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("train_gpt")


@pytest.fixture(scope="module")
def runs(out_dir: Path) -> dict[str, Any]:
    return run_distributed(_run_all, str(out_dir), world_size=2, timeout=240)[0]


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [("cadence-dp", "ddp"), ("cadence-fsdp", "fsdp2"), ("cadence-fsdp", "ddp")],
)
def test_losses_match(runs: dict[str, Any], ours: str, theirs: str) -> None:
    a, b = runs[ours]["losses"], runs[theirs]["losses"]
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(y), (ours, theirs, a, b)
    assert a[-1] < a[0]  # it trains


def test_data_parallel_collectives_equal_ddp(runs: dict[str, Any]) -> None:
    # Two micro-steps, sync on the last only: one bucket all-reduce per step.
    assert runs["ddp"]["collectives"] == [{"all_reduce": 1}] * 6
    assert runs["cadence-dp"]["collectives"] == runs["ddp"]["collectives"]


def test_fully_shard_collectives_equal_fsdp2(runs: dict[str, Any]) -> None:
    theirs = runs["fsdp2"]["collectives"]
    assert runs["cadence-fsdp"]["collectives"] == theirs
    # Per step: 2 micro-steps x (3 forward + 2 backward re-gathers), 3 reduce-scatters.
    assert theirs == [{"all_gather": 10, "reduce_scatter": 3}] * 6


def test_checkpoints_written(out_dir: Path, runs: dict[str, Any]) -> None:
    # torch.save as the script does it: rank 0 for replicas, every rank when sharded.
    for wrapper in ("ddp", "cadence-dp"):
        assert sorted(p.name for p in (out_dir / wrapper).iterdir()) == ["ckpt.pt"]
    for wrapper in ("cadence-fsdp", "fsdp2"):
        names = sorted(p.name for p in (out_dir / wrapper).iterdir())
        assert names == ["ckpt.0.pt", "ckpt.1.pt"]
