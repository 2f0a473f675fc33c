"""``--sample-tokens`` and the summary's throughput, MFU and memory figures.

Specification:
- ``--sample-tokens N`` after the last step: the same greedy tokens on every rank
  (DataParallel, and fully_shard, whose forwards are collective), byte-level text
  decoded as UTF-8, the Markov task's tokens as ids; ``train`` prints them and saves
  ``<run_dir>/samples.txt``;
- the FLOPs' ``N`` is the whole model's parameters outside the embedding tables,
  whatever the layout (fully_shard shards and pipeline stages count whole);
- each rank's peak memory reaches rank 0 (the others get None); ``metrics.json``'s
  summary holds tokens/s, FLOPs per token, MFU (with ``--peak-flops``) and the memory
  of every rank, and the printed table shows them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cadence.models.config import GPTConfig
from cadence.models.gpt import TinyGPT
from cadence.testing import run_distributed
from cadence.train.config import TrainConfig
from cadence.train.metrics import flop_params
from tests.train.bodies_clip import body_run

TEXT = "def hello(name):\n    return f'hello {name}'\n" * 200


def _n(vocab: int) -> int:
    model = TinyGPT(GPTConfig(d_model=16, n_layers=2, vocab_size=vocab))
    tables = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    assert flop_params([model]) == sum(p.numel() for p in model.parameters()) - tables
    return flop_params([model])


@pytest.mark.parametrize("flags", [{}, {"fsdp": True}], ids=["dp", "fsdp"])
def test_samples_are_text_and_agree(tmp_path: Path, flags: dict[str, Any]) -> None:
    data = tmp_path / "code.txt"
    data.write_text(TEXT)
    # Byte-level text needs 256 ids.
    model = GPTConfig(d_model=16, n_layers=2, vocab_size=256)
    run = {**flags, "data": str(data), "sample_tokens": 12, "model": model}
    results = run_distributed(body_run, run, str(tmp_path / "run"), world_size=2, timeout=150)
    first, other = results
    assert first["samples"] == other["samples"]
    lines = first["samples"].split("\n")
    assert lines[0].startswith("# 12 tokens after step 3 (greedy")
    # The held-out 1% of 200 repeats starts on a repeat: its first 16 bytes are TEXT's.
    assert lines[1] == "prompt: " + TEXT[:16]
    assert first["flop_params"] == other["flop_params"] == _n(256)
    assert len(first["peak_memory_bytes"]) == 2 and min(first["peak_memory_bytes"]) > 0
    assert other["peak_memory_bytes"] is None


def test_pipeline_counts_every_stage(tmp_path: Path) -> None:
    results = run_distributed(body_run, {"pp": 2}, str(tmp_path), world_size=2, timeout=150)
    assert [r["flop_params"] for r in results] == [_n(64)] * 2
    assert results[0]["samples"] is None


def test_train_saves_samples_and_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cadence.train.run import train

    cfg = TrainConfig(
        nproc=2,
        steps=3,
        batch_size=8,
        model=GPTConfig(d_model=16, n_layers=2),
        run_dir=str(tmp_path),
        sample_tokens=5,
        peak_flops=1e12,
    )
    train(cfg)
    printed = capsys.readouterr().out
    samples = (tmp_path / "samples.txt").read_text()
    assert samples in printed and "sample: " in samples
    ids = samples.split("sample: ")[1].split()
    assert len(ids) == 5 and all(0 <= int(i) < 64 for i in ids)  # Markov: ids
    summary = json.loads((tmp_path / "metrics.json").read_text())["summary"]
    per_token = 6 * _n(64) + 12 * 2 * 16 * 32
    assert summary["flops_per_token"] == per_token
    assert summary["mfu"] == pytest.approx(summary["tokens_per_s"] * per_token / 2e12)
    assert len(summary["peak_memory_mib_per_rank"]) == 2
    for row in ("FLOPs/token", "MFU", "peak memory"):
        assert row in printed
