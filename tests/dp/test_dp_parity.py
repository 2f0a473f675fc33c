"""DataParallel parity: single-process training on the concatenated batch, and torch DDP."""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.dp import bodies_parity


@pytest.fixture(scope="module")
def parity2(world2: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    return world2[0]["parity"]


@pytest.mark.parametrize("name", sorted(bodies_parity.CONFIGS))
def test_parity_world2(parity2: dict[str, dict[str, float]], name: str) -> None:
    r = parity2[name]
    assert r["grad_ref"] < 1e-6, r
    assert r["param_ref"] < 1e-6, r
    assert r["grad_ddp"] < 1e-6, r
    assert r["param_ddp"] < 1e-6, r


def test_tiny_buckets_really_split(parity2: dict[str, dict[str, float]]) -> None:
    # 5 Linear layers = 10 params, each above the 10-byte cap: one bucket per param.
    assert parity2["tiny_buckets"]["num_buckets"] == 10
    assert parity2["one_huge_bucket"]["num_buckets"] == 1


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_parity_other_world_sizes(world_size: int) -> None:
    configs = {"auto": {}, "async_tiny": {"mode": "async", "dp": {"bucket_cap_mb": 0.001}}}
    results = run_distributed(
        bodies_parity.parity_suite, configs, world_size=world_size, timeout=150
    )
    for name, r in results[0].items():
        assert r["grad_ref"] < 1e-6 and r["param_ref"] < 1e-6, (name, r)
        assert r["grad_ddp"] < 1e-6 and r["param_ddp"] < 1e-6, (name, r)
