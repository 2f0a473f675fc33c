"""``--sample-tokens`` and the summary's throughput, MFU and memory figures.

Specification:
- ``--sample-tokens N`` after the last step: the same greedy tokens on every rank
  (DataParallel, and fully_shard, whose forwards are collective), byte-level text
  decoded as UTF-8, the Markov task's tokens as ids; ``train`` prints them and saves
  ``<run_dir>/samples.txt``;
- the FLOPs' ``N`` is the whole model's parameters outside the embedding tables,
  whatever the layout (fully_shard shards and pipeline stages count whole);
- the attention term's L and d are the trained model's own (TinyGPT's, the embedded
  Llama's, a transformers config's); a factory model's is left out and said to be;
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

pytestmark = pytest.mark.one_lane  # [Note: one lane runs each end-to-end run of cadence train]

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


@pytest.mark.parametrize(
    ("flags", "shape"),
    [
        ({"model": GPTConfig(d_model=16, n_layers=2)}, (2, 16)),
        ({"model_factory": "llama", "model_config": {"dim": 32, "n_layers": 3}}, (3, 32)),
        (
            {
                "model_factory": "hf:LlamaForCausalLM",
                "model_config": {
                    "hidden_size": 48,
                    "num_hidden_layers": 5,
                    "num_attention_heads": 4,
                },
            },
            (5, 48),
        ),
        ({"model_factory": "tests.train.user_models:plain"}, None),
    ],
    ids=["tinygpt", "llama", "hf", "factory"],
)
def test_the_attention_term_uses_the_trained_models_own_layers_and_width(
    flags: dict[str, Any], shape: tuple[int, int] | None
) -> None:
    """L and d of 12LdT are the trained model's, never TinyGPT's defaults for a --model;
    a factory model, which does not say, gets no attention term, and the summary says so."""
    from cadence.train.metrics import attention_shape
    from cadence.train.report import summarize

    cfg = TrainConfig(**flags)
    assert attention_shape(cfg) == shape
    result = {
        "losses": [1.0, 0.5],
        "step_time_median_s": 0.1,
        "flop_params": 1000,
        "comm_exposed_s": 0.0,
        "comm_hidden_s": 0.0,
    }
    summary = summarize(cfg, cfg.layout(1), result)
    seq = cfg.model.seq_len
    if shape is None:
        assert summary["flops_per_token"] == 6 * 1000
        assert "attention not counted" in summary["flops_per_token_formula"]
    else:
        layers, width = shape
        assert summary["flops_per_token"] == 6 * 1000 + 12 * layers * width * seq
        assert f"L={layers}, d={width}, T={seq}" in summary["flops_per_token_formula"]
