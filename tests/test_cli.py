"""`cadence train` end to end: the loss falls, and the run folder has metrics.json.

(The composition of DP, FSDP and PP under the one loop: tests/train/test_loop.py.
The flag rules: tests/train/test_config.py. ``cadence schedule show``:
tests/pipeline/schedule/test_show.py.)
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from cadence.cli import _config_file_defaults, build_parser, main
from cadence.models.config import GPTConfig
from cadence.train._errors import TrainConfigError


@pytest.mark.parametrize(
    "flags",
    [["--finalize", "auto"], ["--pp", "2", "--schedule", "interleaved"]],
    ids=["dp-auto", "pp2-interleaved"],
)
def test_train_loss_falls(tmp_path: Path, flags: list[str], capsys) -> None:
    run = tmp_path / "run"
    assert main(["train", "--steps", "30", "--nproc", "2", "--run-dir", str(run), *flags]) == 0
    metrics = json.loads((run / "metrics.json").read_text())
    losses = metrics["losses"]
    assert len(losses) == 30
    # ln(64) = 4.16 at the start; the chain's floor is ~0.84. 30 steps get well below 2.
    assert losses[0] > 3.5
    assert losses[-1] < 2.0
    assert metrics["summary"]["world_size"] == 2
    assert metrics["config"]["steps"] == 30
    table = capsys.readouterr().out
    assert "last loss" in table and str(run) in table
    _assert_pngs(run)
    assert "steps = 30" in (run / "config.toml").read_text()
    if "--pp" in flags:
        assert metrics["summary"]["mode"] == "pipeline"
        assert metrics["pipeline"]["schedule"] == "interleaved"
        assert metrics["pipeline"]["chunks"] == 2 and metrics["pipeline"]["wrapper"] == "none"
        assert "n/a" in table  # no replicas: no reductions to split into exposed/hidden
    else:
        assert metrics["summary"]["mode"] == "DataParallel"
        assert metrics["collectives_rank0"]["all_reduce"] > 0


def _assert_pngs(run: Path) -> None:
    """loss.png and timeline.png are real pictures matplotlib reads back."""
    import matplotlib.image

    for name in ("loss.png", "timeline.png"):
        data = (run / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        height, width, _ = matplotlib.image.imread(run / name).shape
        assert height > 100 and width > 300, name


def test_config_file_round_trip_and_flags_win(tmp_path: Path) -> None:
    from cadence.train.config import TrainConfig
    from cadence.train.config_file import config_to_toml, read_config_file

    cfg = TrainConfig(steps=7, pp=2, fsdp=True, run_dir="r", model=GPTConfig(d_model=16, n_heads=2))
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg))
    assert TrainConfig(**read_config_file(path)) == cfg
    # the file fills the defaults; a flag on the command line wins
    args = build_parser(_config_file_defaults(["train", "--config", str(path)])).parse_args(
        ["train", "--config", str(path), "--steps", "3"]
    )
    assert (args.steps, args.pp, args.fsdp, args.run_dir) == (3, 2, True, "r")
    assert args.model_base.n_heads == 2 and args.d_model == 16


def _refusal(argv: list[str], capsys) -> str:
    """The one stderr line of a refused command (status 2; see tests/train/test_refused_inputs.py)."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_config_file_misuse_is_refused(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nstepz = 3\n")
    assert "unknown key(s) stepz in [train]" in _refusal(["train", "--config", str(bad)], capsys)
    bad.write_text("steps = 3\n")
    assert "expected one [train] table" in _refusal(["train", "--config", str(bad)], capsys)
    bad.write_text("[train]\nsteps = \n")
    assert "not valid TOML" in _refusal(["train", "--config", str(bad)], capsys)
    missing = ["train", "--config", str(tmp_path / "missing.toml")]
    assert "no such file" in _refusal(missing, capsys)
    with pytest.raises(TrainConfigError, match="no such file"):  # --debug: the exception
        main([*missing, "--debug"])


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed"
)
def test_tensorboard_without_the_package_is_refused(capsys) -> None:
    line = _refusal(["train", "--tensorboard"], capsys)
    assert "--tensorboard needs the tensorboard package" in line


def test_progress_plain_mode_logs_a_line_per_tenth(capsys) -> None:
    from cadence.train.report import Progress

    progress = Progress(20, start=0, tty=False)
    for step in range(20):
        progress(step, 1.0 + step)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 10 and lines[0].startswith("step 2/20  loss 2.0000")
    assert all("\r" not in line for line in lines)


def test_bad_flags_raise_clear_errors_before_launch(capsys) -> None:
    line = _refusal(["train", "--mixed-precision", "bf16"], capsys)
    assert "--mixed-precision needs --fsdp" in line
    assert "--schedule need --pp > 1" in _refusal(["train", "--schedule", "zbv"], capsys)
    line = _refusal(["train", "--finalize", "later"], capsys)  # argparse names the choices
    assert "argument --finalize: invalid choice: 'later'" in line and "cadence train --help" in line


def test_parser_defaults_are_the_config_defaults() -> None:
    args = build_parser().parse_args(["train"])
    assert (args.steps, args.batch_size, args.pp, args.schedule) == (150, 32, 1, "")
    assert args.bucket_cap_mb is None and args.layers == 4


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs tensorboard")
def test_tensorboard_gets_one_point_per_step(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    small = ["--nproc", "2", "--batch-size", "8", "--d-model", "16", "--layers", "2"]
    assert main(["train", *small, "--steps", "4", "--run-dir", str(run), "--tensorboard"]) == 0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    losses = json.loads((run / "metrics.json").read_text())["losses"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (i + 1, pytest.approx(x)) for i, x in enumerate(losses)
    ]
