"""Every refused input of ``cadence`` is one line on stderr, before any rank starts.

Specification:
- a bad flag, a bad config-file key or value, and a flag combination the run cannot
  honour each make ``main`` return a nonzero status (2: the input was refused) and
  print exactly one non-empty line to stderr, naming the flag or key and the value,
  with no Python traceback;
- the refusal comes before any rank starts: ``cadence.train.run.train`` is never
  called for a refused input;
- ``--debug`` (before or after the subcommand) lets the error propagate instead, so
  Python prints the whole traceback (and a debugger can stop at it);
- a failure inside the launched ranks (`LaunchError`) is summarised in one line that
  names the rank and the error and points at ``--debug``; its status is 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import cadence.train.run as run_module
from cadence.cli import build_parser, main
from cadence.errors import CadenceError
from cadence.launch import LaunchError, RankFailure
from cadence.train._errors import TrainConfigError

# Placeholders in the cases below, filled per test: {file} an existing regular file,
# {toml} the case's config file, {tmp} the test's own folder.
HUGE = str(10**30)

# (argv, config file text or None, what the line must name)
CLI_CASES: list[tuple[list[str], tuple[str, ...]]] = [
    (["--steps", "2.5"], ("--steps", "2.5")),
    (["--steps", "x"], ("--steps", "'x'")),
    (["--steps", "0"], ("--steps", "0")),
    (["--steps", "-3"], ("--steps", "-3")),
    (["--steps"], ("--steps",)),
    (["--batch-size", "0"], ("--batch-size", "0")),
    (["--batch-size", "33"], ("--batch-size", "33")),
    (["--nproc", "0"], ("--nproc", "0")),
    (["--lr", "nan"], ("--lr", "nan")),
    (["--lr", "inf"], ("--lr", "inf")),
    (["--lr", "-inf"], ("--lr", "-inf")),
    (["--lr", "-0.1"], ("--lr", "-0.1")),
    (["--collective-timeout", "nan"], ("--collective-timeout", "nan")),
    (["--collective-timeout", "inf"], ("--collective-timeout", "inf")),
    (["--collective-timeout", "0"], ("--collective-timeout", "0")),
    (["--collective-timeout", "-5"], ("--collective-timeout", "-5")),
    (["--collective-timeout", "1e30"], ("--collective-timeout", "1e+30")),
    (["--bucket-cap-mb", "nan"], ("--bucket-cap-mb", "nan")),
    (["--bucket-cap-mb", "inf"], ("--bucket-cap-mb", "inf")),
    (["--bucket-cap-mb", "0"], ("--bucket-cap-mb", "0")),
    (["--bucket-cap-mb", "1", "--fsdp"], ("--bucket-cap-mb",)),
    (["--seed", HUGE], ("--seed", HUGE)),
    (["--pp", "0"], ("--pp", "0")),
    (["--pp", "3"], ("--pp", "3")),
    (["--microbatches", "-1"], ("--microbatches", "-1")),
    (["--chunks", "-1"], ("--chunks", "-1")),
    (["--dp-replicate", "0"], ("--dp-replicate", "0")),
    (["--checkpoint-every", "-1"], ("--checkpoint-every", "-1")),
    (["--keep", "-1"], ("--keep", "-1")),
    (["--keep", "2"], ("--keep",)),
    (["--finalize", "later"], ("--finalize", "later")),
    (["--pp", "2", "--finalize", "manual"], ("--finalize", "manual")),
    (["--mixed-precision", "fp8"], ("--mixed-precision", "fp8")),
    (["--mixed-precision", "bf16"], ("--mixed-precision",)),
    (["--ac", "partial"], ("--ac", "partial")),
    (["--ac", "full", "--pp", "2", "--schedule", "zbv"], ("--ac", "zbv", "split backward")),
    (["--ac", "selective", "--compile"], ("--ac", "--compile")),
    (["--pp", "2", "--schedule", "zz"], ("--schedule", "zz")),
    (["--schedule", "zbv"], ("--schedule",)),
    (
        ["--pp", "2", "--schedule", "dualpipev", "--microbatches", "3", "--batch-size", "6"],
        ("--microbatches", "3"),
    ),
    (["--channel-mode", "ring"], ("--channel-mode", "ring")),
    (["--d-model", "0"], ("--d-model", "0")),
    (["--d-model", "30"], ("--d-model", "30")),
    (["--layers", "0"], ("--layers", "0")),
    (["--d-model", "1000000"], ("--d-model", "1000000")),
    (["--layers", "1000000000"], ("--layers", "1000000000")),
    (["--batch-size", "1000000000"], ("--batch-size", "1000000000")),
    (["--nproc", "65536", "--batch-size", "65536"], ("--nproc", "65536")),
    (["--run-dir", "{file}"], ("--run-dir", "{file}")),
    (["--run-dir", "{file}/sub"], ("--run-dir", "{file}")),
    (["--run-dir", "runs/\udcff"], ("--run-dir",)),
    (["--resume"], ("--resume",)),
    (["--overwrite", "--resume", "--run-dir", "{tmp}/r"], ("--overwrite", "--resume")),
    (["--no-such-flag"], ("--no-such-flag",)),
    (["--config", "{tmp}/missing.toml"], ("--config", "missing.toml")),
    (["--config", "{tmp}"], ("--config",)),
]

TOML_CASES: list[tuple[str, tuple[str, ...]]] = [
    ('[train]\nfsdp = "false"\n', ("fsdp", '"false"')),
    ("[train]\nfsdp = 1\n", ("fsdp", "1")),
    ('[train]\nresume = "yes"\n', ("resume", '"yes"')),
    ("[train]\nsteps = 2.5\n", ("steps", "2.5")),
    ("[train]\nsteps = true\n", ("steps", "true")),
    ('[train]\nsteps = "3"\n', ("steps", '"3"')),
    ("[train]\nsteps = nan\n", ("steps", "nan")),
    ("[train]\nsteps = [3]\n", ("steps", "[3]")),
    ("[train]\nlr = nan\n", ("lr", "nan")),
    ("[train]\nlr = inf\n", ("lr", "inf")),
    ("[train]\nlr = -0.5\n", ("lr", "-0.5")),
    ("[train]\ntimeout = nan\n", ("timeout", "nan")),
    ("[train]\ntimeout = 0\n", ("timeout", "0")),
    ("[train]\ntimeout = -inf\n", ("timeout", "-inf")),
    ("[train]\ncollective_timeout = nan\n", ("collective_timeout", "nan")),
    ("[train]\nbucket_cap_mb = inf\n", ("bucket_cap_mb", "inf")),
    ("[train]\nnproc = 0\n", ("nproc", "0")),
    ("[train]\nkeep = -1\n", ("keep", "-1")),
    ("[train]\ncheckpoint_every = 1.5\n", ("checkpoint_every", "1.5")),
    ("[train]\nseed = 0.5\n", ("seed", "0.5")),
    ("[train]\npp = false\n", ("pp", "false")),
    ("[train]\ndp_replicate = 0\n", ("dp_replicate", "0")),
    ('[train]\nfinalize = "later"\n', ("finalize", '"later"')),
    ("[train]\nmixed_precision = 16\n", ("mixed_precision", "16")),
    ("[train]\nschedule = 1\n", ("schedule", "1")),
    ('[train]\nchannel_mode = "ring"\n', ("channel_mode", '"ring"')),
    ("[train]\nrun_dir = 5\n", ("run_dir", "5")),
    ('[train]\nrun_dir = "a\\u0000b"\n', ("run_dir",)),
    ("[train]\nstepz = 3\n", ("stepz",)),
    ("[train]\nmodel = 3\n", ("model", "3")),
    ("[train]\nsteps = \n", ("{toml}", "line 2")),
    ("steps = 3\n", ("{toml}", "[train]")),
    ('[train.model]\nd_model = "64"\n', ("d_model", '"64"')),
    ("[train.model]\nn_heads = 0\n", ("n_heads", "0")),
    ("[train.model]\nd_model = 30\n", ("d_model", "30")),
    ("[train.model]\ntie_embeddings = 1\n", ("tie_embeddings", "1")),
    ("[train.model]\nlayers = 4\n", ("layers",)),
    ("[train.model]\nvocab_size = 1e9\n", ("vocab_size", "1000000000")),
]


def _fill(text: str, tmp: Path) -> str:
    return text.format(file=tmp / "a-file", tmp=tmp, toml=tmp / "c.toml")


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a refused input ever reaches the launch."""

    def refuse(cfg: object) -> None:
        raise AssertionError(f"validation let this reach the launch: {cfg}")

    monkeypatch.setattr(run_module, "train", refuse)


def _one_line(rc: int, capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    assert rc != 0
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].strip(), err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "names"),
    CLI_CASES,
    ids=[" ".join(a).encode("ascii", "replace").decode() for a, _ in CLI_CASES],
)
def test_a_refused_flag_is_one_line(
    argv: list[str], names: tuple[str, ...], tmp_path: Path, capsys, no_launch
) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    rc = main(["train", *(_fill(a, tmp_path) for a in argv)])
    line = _one_line(rc, capsys)
    assert rc == 2
    for name in names:
        assert _fill(name, tmp_path) in line, line


@pytest.mark.parametrize(("text", "names"), TOML_CASES, ids=[t for t, _ in TOML_CASES])
def test_a_refused_config_file_is_one_line(
    text: str, names: tuple[str, ...], tmp_path: Path, capsys, no_launch
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    rc = main(["train", "--config", str(path)])
    line = _one_line(rc, capsys)
    assert rc == 2
    assert str(path) in line, line  # the file is named
    for name in names:
        assert _fill(name, tmp_path) in line, line


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path: Path, capsys, no_launch) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(b'[train]\nrun_dir = "\xff"\n')
    line = _one_line(main(["train", "--config", str(path)]), capsys)
    assert str(path) in line and "UTF-8" in line


def test_other_subcommands_refuse_in_one_line(tmp_path: Path, capsys) -> None:
    assert "'nope'" in _one_line(main(["schedule", "show", "nope"]), capsys)
    assert "--pp" in _one_line(main(["schedule", "show", "1f1b", "--pp", "x"]), capsys)
    assert "'ddp'" in _one_line(main(["bench", "ddp"]), capsys)
    assert "command" in _one_line(main([]), capsys)
    line = _one_line(main(["bench", "report", "--quick", "--results", str(tmp_path)]), capsys)
    assert "--quick" in line


def test_usage_errors_and_refusals_exit_2(capsys, no_launch) -> None:
    assert main(["train", "--steps", "x"]) == 2  # argparse
    assert main(["train", "--lr", "nan"]) == 2  # TrainConfig
    capsys.readouterr()


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_lets_the_error_propagate(where: str, tmp_path: Path, no_launch) -> None:
    def argv(*rest: str) -> list[str]:
        return ["--debug", "train", *rest] if where == "before" else ["train", *rest, "--debug"]

    with pytest.raises(TrainConfigError, match="--lr"):
        main(argv("--lr", "nan"))
    bad = tmp_path / "c.toml"
    bad.write_text('[train]\nfsdp = "false"\n')
    with pytest.raises(TrainConfigError, match="fsdp"):
        main(argv("--config", str(bad)))
    with pytest.raises(CadenceError, match="--steps"):
        main(argv("--steps", "x"))


def test_debug_is_a_flag_before_or_after_the_subcommand() -> None:
    parser = build_parser()
    assert parser.parse_args(["train"]).debug is False
    assert parser.parse_args(["--debug", "train"]).debug is True
    assert parser.parse_args(["train", "--debug"]).debug is True
    assert parser.parse_args(["schedule", "show", "1f1b", "--debug"]).debug is True


def _launch_error(reason: str) -> LaunchError:
    failure = RankFailure(
        1,
        reason,
        1 if reason == "raised" else -9,
        "CollectiveTimeoutError" if reason == "raised" else None,
        "rank 1 timed out in step 2 waiting for its peers\nsecond line of the message"
        if reason == "raised"
        else "killed by signal 9",
        "Traceback (most recent call last):\n  File 'x.py', line 1\nCollectiveTimeoutError: ..."
        if reason == "raised"
        else "",
        4242,
    )
    return LaunchError(failure, [RankFailure(0, "exited", -15, None, "killed by signal 15", "")])


@pytest.mark.parametrize("reason", ["raised", "exited", "timeout"])
def test_a_failed_rank_is_one_line_pointing_at_debug(
    reason: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    def fail(cfg: object) -> None:
        raise _launch_error(reason)

    monkeypatch.setattr(run_module, "train", fail)
    rc = main(["train", "--steps", "1"])
    line = _one_line(rc, capsys)
    assert rc == 1
    assert "rank 1" in line and "--debug" in line
    if reason == "raised":
        assert "CollectiveTimeoutError" in line and "step 2" in line
    with pytest.raises(LaunchError):
        main(["train", "--steps", "1", "--debug"])
