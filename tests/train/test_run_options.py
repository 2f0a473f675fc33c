"""The options of a training run: warmup and cosine, clipping, MFU, samples.

Specification:
- bad values are refused in one line, naming the flag, before any rank starts: a
  negative warmup, a warmup that does not end before the last step, ``--min-lr``
  above ``--lr`` or without the cosine schedule, a non-positive clip bound or peak
  FLOP/s, negative sample counts or temperatures, a temperature without samples,
  samples from a pipeline; the CLI refuses them alike;
- the new keys read back from ``config.toml``;
- the schedule: step ``k`` of ``W`` warmup steps runs at ``lr (k + 1) / W``, the
  first step after the warmup at ``lr``, the last at ``min_lr``, and the cosine is
  monotone between; ``constant`` stays at ``lr`` after the warmup;
- FLOPs per token are ``6 N + 12 L d T``; MFU is omitted (None, with the reason)
  without ``--peak-flops``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from cadence.cli import main
from cadence.models.config import GPTConfig
from cadence.train._errors import TrainConfigError
from cadence.train.config import TrainConfig
from cadence.train.config_file import read_config_file
from cadence.train.metrics import flops_per_token, mfu
from cadence.train.report import write_config

pytestmark = pytest.mark.torch_free

REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"warmup_steps": -1}, "--warmup-steps"),
    ({"warmup_steps": 150}, "--warmup-steps 150 must be below --steps 150"),
    ({"lr_schedule": "linear"}, "--lr-schedule"),
    ({"min_lr": 1e-4}, "--min-lr is where the cosine schedule ends"),
    ({"lr_schedule": "cosine", "min_lr": 1.0}, "--min-lr 1.0 is above --lr"),
    ({"lr_schedule": "cosine", "min_lr": -1.0}, "--min-lr"),
    ({"clip_grad_norm": 0.0}, "--clip-grad-norm"),
    ({"clip_grad_norm": -1.0}, "--clip-grad-norm"),
    ({"clip_grad_norm": math.inf}, "--clip-grad-norm"),
    ({"peak_flops": 0.0}, "--peak-flops"),
    ({"sample_tokens": -1}, "--sample-tokens"),
    ({"sample_tokens": 4, "sample_temperature": -0.5}, "--sample-temperature"),
    ({"sample_temperature": 0.7}, "--sample-temperature sets how --sample-tokens"),
    ({"sample_tokens": 4, "pp": 2}, "--sample-tokens needs --pp 1"),
]


@pytest.mark.parametrize(("values", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_bad_values_are_refused_in_one_line(values: dict[str, Any], message: str) -> None:
    with pytest.raises(TrainConfigError) as info:
        TrainConfig(**values)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["--warmup-steps", "-3"],
        ["--min-lr", "0.1", "--lr-schedule", "cosine", "--lr", "0.01"],
        ["--clip-grad-norm", "0"],
        ["--sample-tokens", "8", "--pp", "2"],
    ],
)
def test_the_cli_refuses_before_launch(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("cadence train: error:") and "\n" not in err


def test_the_new_keys_read_back(tmp_path: Path) -> None:
    cfg = TrainConfig(
        steps=20,
        warmup_steps=5,
        lr_schedule="cosine",
        min_lr=1e-5,
        clip_grad_norm=1.0,
        peak_flops=9.89e14,
        sample_tokens=32,
        sample_temperature=0.8,
        model=GPTConfig(d_model=16, n_heads=2),
    )
    assert TrainConfig(**read_config_file(write_config(cfg, tmp_path))) == cfg


def test_flops_per_token_and_mfu() -> None:
    assert flops_per_token(1000, 2, 16, 32) == 6 * 1000 + 12 * 2 * 16 * 32
    value, note = mfu(100.0, 10**6, None, 2)
    assert value is None and "--peak-flops" in note
    value, _ = mfu(100.0, 10**6, 1e9, 2)
    assert value == pytest.approx(100.0 * 10**6 / (1e9 * 2))
    assert mfu(float("nan"), 10**6, 1e9, 2)[0] is None
