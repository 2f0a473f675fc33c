"""`Topology.build` creates each axis's groups with at most one world collective.

See [Note: groups by split, flat in the world] in cadence/topology.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.foundation import bodies_group_creation


@pytest.fixture(scope="module")
def pp2_shard2() -> list[dict[str, Any]]:
    # World 4 as pp=2 x dp_shard=2: pp groups [0,2] [1,3], one-rank replica groups,
    # dp_shard groups [0,1] [2,3], and dp the same ranks as dp_shard.
    return run_distributed(bodies_group_creation.build_counting, 1, 2, 2, world_size=4, timeout=90)


def test_each_group_holds_the_ranks_of_its_axis(pp2_shard2: list[dict[str, Any]]) -> None:
    sums = {"pp": [2.0, 4.0, 2.0, 4.0], "dp_shard": [1.0, 1.0, 5.0, 5.0]}
    for rank, r in enumerate(pp2_shard2):
        assert r["pp"] == (2, sums["pp"][rank])
        assert r["dp_shard"] == r["dp"] == (2, sums["dp_shard"][rank])
        assert r["dp_replicate"] == (1, float(rank))


def test_an_axis_over_the_same_ranks_as_another_shares_its_group(
    pp2_shard2: list[dict[str, Any]],
) -> None:
    assert all(r["dp_is_dp_shard"] for r in pp2_shard2)


def test_one_split_per_axis_where_the_backend_splits(pp2_shard2: list[dict[str, Any]]) -> None:
    for r in pp2_shard2:
        if r["can_split"]:
            # pp, dp_replicate and dp_shard; dp reuses dp_shard's: flat in the world size.
            assert r["calls"] == {"new_group": 0, "split_group": 3}
        else:
            # One new_group per group of each axis, on every rank (2 + 4 + 2).
            assert r["calls"] == {"new_group": 8, "split_group": 0}


def test_an_axis_spanning_the_world_is_the_default_group() -> None:
    results = run_distributed(
        bodies_group_creation.build_counting, 1, 1, 2, world_size=2, timeout=60
    )
    for r in results:
        assert r["pp_is_world"] and r["pp"][0] == 2
        assert r["dp"] == r["dp_shard"] == r["dp_replicate"] == (1, r["dp"][1])
