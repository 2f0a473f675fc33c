"""A written ``config.toml`` always reads back to the same `TrainConfig`.

Specification:
- ``write_config`` writes UTF-8 whatever the locale, and ``--config`` on the file gives
  back an equal `TrainConfig` for any ``--run-dir`` cadence accepts: characters
  outside the Basic Multilingual Plane (an emoji), quotes, backslashes, newlines and
  every control character, TOML's own delimiters;
- the numbers read back exactly (floats by their shortest repr);
- a ``--run-dir`` that cannot be stored as UTF-8 text (undecodable bytes of a POSIX
  path, seen by Python as lone surrogates) or that holds a NUL is refused when the
  config is made, not after training.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.models.config import GPTConfig
from cadence.train._errors import TrainConfigError
from cadence.train.config import TrainConfig
from cadence.train.config_file import read_config_file
from cadence.train.report import write_config

pytestmark = pytest.mark.torch_free

AWKWARD = [
    "runs/\U0001f680",
    'runs/"quoted"',
    "runs\\back\\slash",
    "trailing\\",
    "\\u0041 is not A",
    "a\nb\r\nc",
    "tab\there",
    "".join(chr(c) for c in range(1, 32)) + "\x7f",
    "\x1b[31mred",
    "\u2028\u2029\x85",
    "\ufeffbom",
    "e\u0301 combining",
    "'''",
    '"""',
    "# not a comment",
    "key = 1\n[train]",
    "\ud7ff\ue000\U0010ffff",
]


def _round_trip(tmp_path: Path, cfg: TrainConfig) -> TrainConfig:
    path = write_config(cfg, tmp_path)
    path.read_bytes().decode("utf-8")  # UTF-8, as TOML requires
    return TrainConfig(**read_config_file(path))


@pytest.mark.parametrize("run_dir", AWKWARD, ids=[ascii(s) for s in AWKWARD])
def test_awkward_run_dirs_read_back(tmp_path: Path, run_dir: str) -> None:
    cfg = TrainConfig(run_dir=run_dir, steps=7, model=GPTConfig(d_model=16, n_heads=2))
    assert _round_trip(tmp_path, cfg) == cfg


def test_the_emoji_is_written_as_itself(tmp_path: Path) -> None:
    path = write_config(TrainConfig(run_dir="runs/\U0001f680"), tmp_path)
    assert "runs/\U0001f680" in path.read_bytes().decode("utf-8")


@settings(max_examples=200, deadline=None)
@given(
    run_dir=st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00")),
    lr=st.floats(min_value=0.0, max_value=1e300, allow_nan=False),
    timeout=st.floats(min_value=1e-300, max_value=1e300),
)
def test_any_accepted_config_reads_back(run_dir: str, lr: float, timeout: float) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(run_dir=run_dir, lr=lr, timeout=timeout, bucket_cap_mb=lr or None)
        assert _round_trip(Path(tmp), cfg) == cfg


@pytest.mark.parametrize("run_dir", ["runs/\udcff", "a\x00b"], ids=["surrogate", "nul"])
def test_a_run_dir_toml_cannot_hold_is_refused_up_front(run_dir: str) -> None:
    with pytest.raises(TrainConfigError, match="--run-dir"):
        TrainConfig(run_dir=run_dir)


@pytest.mark.parametrize(
    "data",
    [
        dict(data="stdlib", eval_every=3, eval_batches=2, val_fraction=0.05),
        dict(data="runs/\U0001f680/train.bin", data_dtype="uint32"),
        dict(data="corpus/", tokenizer='tok "quoted".json', eval_every=1),
    ],
    ids=["stdlib", "shards", "text"],
)
def test_data_options_read_back(tmp_path: Path, data: dict) -> None:
    cfg = TrainConfig(**data, model=GPTConfig(vocab_size=256, d_model=16, n_heads=2))
    assert _round_trip(tmp_path, cfg) == cfg
