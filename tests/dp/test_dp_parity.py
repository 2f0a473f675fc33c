"""DataParallel parity: single-process training on the concatenated batch, and torch DDP."""

from __future__ import annotations

import pytest

from cadence.testing import run_distributed
from tests.dp import bodies_parity as B

CONFIGS = {
    "auto": {},
    "manual": {"mode": "manual"},
    "async": {"mode": "async"},
    "tiny_buckets": {"dp": {"bucket_cap_mb": 1e-5}},
    "tiny_buckets_async": {"mode": "async", "dp": {"bucket_cap_mb": 1e-5}},
    "one_huge_bucket": {"dp": {"bucket_cap_mb": 1000.0}},
    "bucket_view": {"dp": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001}},
    "bucket_view_zero_grad": {
        "dp": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001},
        "set_to_none": False,
    },
    "find_unused_all_used": {"dp": {"find_unused_parameters": True, "bucket_cap_mb": 0.001}},
}


@pytest.fixture(scope="module")
def world2() -> dict[str, dict[str, float]]:
    results = run_distributed(B.parity_suite, CONFIGS, world_size=2)
    return results[0]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parity_world2(world2: dict[str, dict[str, float]], name: str) -> None:
    r = world2[name]
    assert r["grad_ref"] < 1e-6, r
    assert r["param_ref"] < 1e-6, r
    assert r["grad_ddp"] < 1e-6, r
    assert r["param_ddp"] < 1e-6, r


def test_tiny_buckets_really_split(world2: dict[str, dict[str, float]]) -> None:
    # 5 Linear layers = 10 params, each above the 10-byte cap: one bucket per param.
    assert world2["tiny_buckets"]["num_buckets"] == 10
    assert world2["one_huge_bucket"]["num_buckets"] == 1


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_parity_other_world_sizes(world_size: int) -> None:
    configs = {"auto": {}, "async_tiny": {"mode": "async", "dp": {"bucket_cap_mb": 0.001}}}
    results = run_distributed(B.parity_suite, configs, world_size=world_size, timeout=150)
    for name, r in results[0].items():
        assert r["grad_ref"] < 1e-6 and r["param_ref"] < 1e-6, (name, r)
        assert r["grad_ddp"] < 1e-6 and r["param_ddp"] < 1e-6, (name, r)
