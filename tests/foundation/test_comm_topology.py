"""The collective adapter, handles, the event log and topology groups."""

from __future__ import annotations

from typing import Any

import pytest

import cadence


@pytest.fixture(scope="module")
def collectives(world3: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["collectives"] for r in world3]


def test_reductions(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        assert r["avg"] == [2.0] * 4  # (1 + 2 + 3) / 3, via SUM + divide on gloo
        assert r["sum"] == [6.0] * 4
        assert r["all_gather"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        assert r["broadcast"] == [0.0] * 3
    # reduce-scatter of arange(6) from 3 ranks, averaged: rank r gets [2r, 2r+1].
    assert [r["reduce_scatter_avg"] for r in collectives] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_handle_wait_is_idempotent(collectives: list[dict[str, Any]]) -> None:
    r = collectives[0]
    assert r["on_complete_calls"] == 1
    assert r["handle_done"]


def test_handle_retry_after_cleanup_exception_completes_once(
    collectives: list[dict[str, Any]],
) -> None:
    r = collectives[0]
    assert r["first_wait_raised"] and not r["done_after_failure"]
    assert r["attempts"] == 2


def test_event_log_counts_order_and_bytes(collectives: list[dict[str, Any]]) -> None:
    r = collectives[0]
    assert r["counts"]["all_reduce"] == 4
    assert r["counts"]["all_gather"] == 1 and r["counts"]["reduce_scatter"] == 1
    assert r["counts"]["broadcast"] == 1
    assert r["order"]  # issue <= mark <= wait start <= wait end
    assert r["in_flight_covers_mark"]
    assert r["wait_split"] == 0.0  # per-kind wait times add up to the total
    assert r["bytes"] == 8 * 4


def test_point_to_point_and_objects(collectives: list[dict[str, Any]]) -> None:
    assert collectives[0]["p2p"] == [1.0] * 3
    assert collectives[1]["p2p"] == [0.0] * 3
    assert collectives[2]["objects"] == [{"r": 0}, {"r": 1}, {"r": 2}]


def test_topology_validation_names_the_numbers() -> None:
    with pytest.raises(
        ValueError, match="dp_replicate=2 x dp_shard=2 x pp=1 = 4, but the world size is 3"
    ):
        cadence.Topology(dp_replicate=2, dp_shard=2).validate(3)
    with pytest.raises(ValueError, match="positive int"):
        cadence.Topology(dp_shard=0)
    with pytest.raises(ValueError, match="positive int"):
        cadence.Topology(pp=1.5)  # type: ignore[arg-type]


def test_rank_layout_pipeline_outermost() -> None:
    topo = cadence.Topology(dp_replicate=2, dp_shard=2, pp=2)
    assert topo.world_size == 8
    assert topo.coords(5) == (1, 0, 1)
    assert all(topo.rank_of(topo.coords(r)) == r for r in range(8))
    assert topo.groups_of("dp_shard") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.groups_of("dp_replicate") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.groups_of("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.groups_of("dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_topology_groups_at_world4(world4: dict[str, Any]) -> None:
    results = [r["groups"] for r in world4]
    assert [r["coords"] for r in results] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert results[0]["dp"] == (4, 6.0)
    assert results[0]["dp_shard"] == (2, 1.0)  # ranks 0 + 1
    assert results[0]["dp_replicate"] == (2, 2.0)  # ranks 0 + 2
    assert results[3]["dp_replicate"] == (2, 4.0)  # ranks 1 + 3
    assert results[0]["pp"] == (1, 0.0)


def test_rank_layout_is_owned_by_topology() -> None:
    # pp=2 x dp_replicate=2 x dp_shard=2: pipeline outermost, shard innermost.
    topo = cadence.Topology(dp_replicate=2, dp_shard=2, pp=2)
    assert [topo.dp_rank_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert topo.dp_ranks_of(5) == [4, 5, 6, 7]
    assert topo.pp_ranks_of(5) == [1, 5]
    assert topo.pp_ranks_of(2) == [2, 6]
    # Replica r of a global batch of 8 takes rows [2r, 2r + 2), whatever its pp stage.
    assert [topo.local_slice(r, 8) for r in (0, 3, 4, 7)] == [
        slice(0, 2),
        slice(6, 8),
        slice(0, 2),
        slice(6, 8),
    ]
    with pytest.raises(ValueError, match="does not split over dp_size=4"):
        topo.local_slice(0, 6)
