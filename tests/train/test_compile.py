"""``cadence train --compile``: one compile per data-parallel group, then the cache.

Specification:
- pp=1: rank 0 compiles the wrapped model's forward, rank 1 receives it; pp=2: each
  pipeline rank compiles its own stage (its data-parallel group is itself);
- a second run in the same run folder loads from ``<run_dir>/precompile`` on every rank;
- the compiled run trains like the eager one (aot_eager: same losses to 1e-6);
- ``--compile --fsdp``: each fully_shard block is compiled (the root's forward stays
  eager: its graph would hold the blocks' all-gathers); rank 0 compiles the first block,
  rank 1 receives it, the second block (same architecture) loads it from the cache,
  and the losses equal the eager ``--fsdp`` run's;
- ``--model llama`` compiles the same way: its blocks under ``--fsdp``, its stages
  under ``--pp``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.models.config import GPTConfig
from cadence.testing import run_distributed
from tests.train.bodies_compile import body_compile

# The embedded Llama at a tiny size (TinyGPT's own shape flags stay at their defaults).
LLAMA = {
    "model": GPTConfig(),
    "model_factory": "llama",
    "model_config": {"dim": 16, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1},
}


@pytest.mark.parametrize(
    ("flags", "sources"),
    [
        ({}, ["compiled", "received"]),
        ({"pp": 2}, ["compiled", "compiled"]),
        ({"fsdp": True}, ["compiled,cache", "received,cache"]),
        ({"fsdp": True, "mixed_precision": "bf16"}, ["compiled,cache", "received,cache"]),
        ({**LLAMA, "fsdp": True}, ["compiled,cache", "received,cache"]),
        ({**LLAMA, "pp": 2}, ["compiled", "compiled"]),
    ],
    ids=["dp", "pp2", "fsdp", "fsdp-bf16", "llama-fsdp", "llama-pp2"],
)
def test_compile_once_per_group_then_cache(tmp_path: Path, flags: dict, sources: list) -> None:
    (r, _) = run_distributed(body_compile, flags, str(tmp_path), world_size=2, timeout=240)
    assert [p["source"] for p in r["first"]] == sources
    assert [p["source"] for p in r["again"]] == [
        ",".join("cache" for _ in s.split(",")) for s in sources
    ]
    assert r["first"][0]["compile_s"] > 0 and r["again"][0]["compile_s"] == 0
    assert max(abs(a - b) for a, b in zip(r["eager"], r["compiled"])) < 1e-6
