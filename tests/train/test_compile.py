"""``cadence train --compile``: one compile per data-parallel group, then the cache.

Specification:
- pp=1: rank 0 compiles the wrapped model's forward, rank 1 receives it; pp=2: each
  pipeline rank compiles its own stage (its data-parallel group is itself);
- a second run in the same run folder loads from ``<run_dir>/precompile`` on every rank;
- the compiled run trains like the eager one (aot_eager: same losses to 1e-6);
- ``--compile --fsdp`` is refused before anything starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.testing import run_distributed
from cadence.train.config import TrainConfig, TrainConfigError
from tests.train.bodies_compile import body_compile


@pytest.mark.parametrize(
    ("flags", "sources"),
    [({}, ["compiled", "received"]), ({"pp": 2}, ["compiled", "compiled"])],
    ids=["dp", "pp2"],
)
def test_compile_once_per_group_then_cache(tmp_path: Path, flags: dict, sources: list) -> None:
    (r, _) = run_distributed(body_compile, flags, str(tmp_path), world_size=2, timeout=240)
    assert [p["source"] for p in r["first"]] == sources
    assert [p["source"] for p in r["again"]] == ["cache", "cache"]
    assert r["first"][0]["compile_s"] > 0 and r["again"][0]["compile_s"] == 0
    assert max(abs(a - b) for a, b in zip(r["eager"], r["compiled"])) < 1e-6


def test_compile_with_fsdp_is_refused() -> None:
    with pytest.raises(TrainConfigError, match="--compile with --fsdp is not supported yet"):
        TrainConfig(compile=True, fsdp=True)
