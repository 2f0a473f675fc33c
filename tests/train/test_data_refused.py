"""Bad ``--data`` input is one line on stderr, status 2, before any rank starts.

Specification (through ``cadence.cli.main``, as test_refused_inputs.py):
- a path that does not exist; data shorter than one rank's share of a batch, or whose
  held-out part is shorter than one window; a token id at or above the model's
  vocabulary; a dtype that is not uint16/uint32, that does not divide the file, or
  that contradicts llm.c's header; a header whose token count disagrees with the
  file; ``--tokenizer`` without the tokenizers package (or a file that does not load,
  where the package is installed), or on shards; data flags without ``--data``;
  bad ``[train]`` data keys in a config file;
- ``--data`` without ``--vocab-size`` gives the model the data's vocabulary (256 for
  bytes, the largest id + 1 for shards); a config file's ``vocab_size`` is kept, and
  refused when the data needs more.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import cadence.train.run as run_module
from cadence.cli import main
from tests.train.test_data import write_llmc, write_nanogpt

HAVE_TOKENIZERS = importlib.util.find_spec("tokenizers") is not None


def _files(tmp: Path) -> None:
    write_nanogpt(tmp / "short.bin", np.arange(50))
    write_nanogpt(tmp / "big-id.bin", np.arange(3_000) % 301)
    write_nanogpt(tmp / "odd.bin", np.arange(10_001))  # 20002 bytes: not whole uint32s
    write_nanogpt(tmp / "small-val.bin", np.arange(3_000) % 64)
    write_llmc(tmp / "llmc.bin", np.arange(3_000) % 64)
    cut = write_llmc(tmp / "cut.bin", np.arange(3_000) % 64)
    cut.write_bytes(cut.read_bytes()[:-100])
    (tmp / "text.txt").write_text("hello " * 2_000)
    (tmp / "tok.json").write_text("{not a tokenizer")


CASES: list[tuple[list[str], tuple[str, ...]]] = [
    (["--data", "{tmp}/missing"], ("--data", "missing", "no such file or folder")),
    (["--data", "{tmp}/short.bin"], ("--data", "50 training tokens", "--batch-size")),
    (
        ["--data", "{tmp}/big-id.bin", "--vocab-size", "256"],
        ("ids up to 300", "vocab_size is 256", "--vocab-size 301"),
    ),
    (["--data", "{tmp}/odd.bin", "--data-dtype", "uint32"], ("20002 bytes", "uint32")),
    (["--data", "{tmp}/llmc.bin", "--data-dtype", "int8"], ("--data-dtype", "int8")),
    (["--data", "{tmp}/llmc.bin", "--data-dtype", "uint32"], ("header says uint16",)),
    (["--data", "{tmp}/cut.bin"], ("header says 3000 tokens", "cut short")),
    (["--data", "{tmp}/small-val.bin"], ("held-out", "--val-fraction")),
    (
        ["--data", "{tmp}/small-val.bin", "--tokenizer", "{tmp}/tok.json"],
        ("--tokenizer", "already tokenized"),
    ),
    (["--data", "{tmp}/text.txt", "--data-dtype", "uint16"], ("--data-dtype", "text")),
    (["--eval-every", "2"], ("--eval-every", "need --data")),
    (["--val-fraction", "0.1"], ("--val-fraction", "need --data")),
    (["--data", "stdlib", "--eval-batches", "2"], ("--eval-batches", "--eval-every")),
    (["--data", "stdlib", "--val-fraction", "0"], ("--val-fraction", "0")),
    (["--data", "stdlib", "--vocab-size", "200"], ("256 ids", "--vocab-size 256")),
    (
        ["--data", "{tmp}/text.txt", "--tokenizer", "{tmp}/tok.json"],
        ("does not load",) if HAVE_TOKENIZERS else ("pip install tokenizers",),
    ),
]

TOML_CASES: list[tuple[str, tuple[str, ...]]] = [
    ("[train]\ndata = 5\n", ("data", "5")),
    ('[train]\ndata = "stdlib"\nval_fraction = 0.9\n', ("val_fraction", "0.9")),
    ('[train]\ndata = "stdlib"\ndata_dtype = "int8"\n', ("data_dtype", '"int8"')),
    ('[train]\ndata = "stdlib"\n\n[train.model]\nvocab_size = 128\n', ("256 ids", "128")),
]


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list:
    """The configs that reached the launch (none may, for a refused input)."""
    seen: list = []
    monkeypatch.setattr(run_module, "train", seen.append)
    return seen


def _one_line(rc: int, capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cadence train: error: "), err
    return lines[0]


@pytest.mark.parametrize(("argv", "names"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_data_is_refused_in_one_line(
    argv: list[str], names: tuple[str, ...], tmp_path: Path, capsys, captured: list
) -> None:
    _files(tmp_path)
    line = _one_line(main(["train", *(a.format(tmp=tmp_path) for a in argv)]), capsys)
    for name in names:
        assert name in line, line
    assert captured == []


@pytest.mark.parametrize(("text", "names"), TOML_CASES, ids=[t for t, _ in TOML_CASES])
def test_bad_data_keys_in_a_config_file_are_refused(
    text: str, names: tuple[str, ...], tmp_path: Path, capsys, captured: list
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    line = _one_line(main(["train", "--config", str(path)]), capsys)
    for name in names:
        assert name in line, line
    assert captured == []


def test_the_model_takes_the_data_vocabulary(tmp_path: Path, captured: list) -> None:
    _files(tmp_path)
    assert main(["train", "--data", "stdlib"]) == 0
    assert main(["train", "--data", str(tmp_path / "big-id.bin"), "--val-fraction", "0.1"]) == 0
    assert main(["train", "--data", "stdlib", "--vocab-size", "300"]) == 0
    path = tmp_path / "c.toml"
    path.write_text('[train]\ndata = "stdlib"\n\n[train.model]\nvocab_size = 512\n')
    assert main(["train", "--config", str(path)]) == 0
    assert [c.model.vocab_size for c in captured] == [256, 301, 300, 512]
    assert main(["train"]) == 0  # no --data: the Markov task's 64, as before
    assert captured[-1].model.vocab_size == 64 and captured[-1].data == ""
