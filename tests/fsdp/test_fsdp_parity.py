"""Parity with single-process training and with torch's fully_shard; collective counts."""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.fsdp.bodies_parity import parity_body

TOL = 1e-6


@pytest.fixture(scope="module")
def ws2(world2: list[dict[str, Any]]) -> dict[str, Any]:
    return world2[0]["parity"]


@pytest.fixture(scope="module")
def ws3() -> dict[str, Any]:
    return run_distributed(parity_body, world_size=3, timeout=120)[0]


@pytest.mark.parametrize("kind", ["mlp", "tokens"])
def test_parity_single_process_ws2(ws2: dict[str, Any], kind: str) -> None:
    assert ws2[f"{kind}_vs_single"] <= TOL


@pytest.mark.parametrize("kind", ["mlp", "tokens"])
def test_parity_torch_fully_shard_ws2(ws2: dict[str, Any], kind: str) -> None:
    assert ws2[f"{kind}_vs_fsdp2"] <= TOL


@pytest.mark.parametrize("kind", ["mlp", "tokens"])
def test_parity_uneven_padding_ws3(ws3: dict[str, Any], kind: str) -> None:
    assert ws3[f"{kind}_vs_single"] <= TOL
    assert ws3[f"{kind}_vs_fsdp2"] <= TOL


def test_sharding_is_dtensor_shard0_with_torch_chunk_rows(
    ws2: dict[str, Any], ws3: dict[str, Any]
) -> None:
    assert ws2["is_dtensor"] and ws2["placements"] == "(Shard(dim=0),)"
    # Linear(8, 7) and Linear(7, 5): rank 0 holds ceil(7/3) = 3 and ceil(5/3) = 2 rows.
    assert (ws3["local_rows_l0"], ws3["local_rows_l2"]) == (3, 2)
    assert (ws2["local_rows_l0"], ws2["local_rows_l2"]) == (4, 3)


def test_counts_reduce_every_microbatch(ws2: dict[str, Any]) -> None:
    assert ws2["every_cadence"] == [(7, 4), (7, 4)]
    assert ws2["every_cadence"] == ws2["every_fsdp2"]
    assert ws2["every_cadence_parity"] <= TOL


def test_counts_no_sync_then_sync(ws2: dict[str, Any]) -> None:
    assert ws2["nosync_cadence"] == [(7, 0), (7, 4)]
    assert ws2["nosync_cadence"] == ws2["nosync_fsdp2"]
    assert ws2["nosync_cadence_parity"] <= TOL


def test_counts_no_sync_no_reshard_after_backward(ws2: dict[str, Any]) -> None:
    # First microbatch 7 AG / 0 RS, last 3 AG / 4 RS: the last backward reuses the kept
    # unsharded parameters. torch's fully_shard, counted live, gives the same.
    assert ws2["nosync_noreshard_cadence"] == [(7, 0), (3, 4)]
    assert ws2["nosync_noreshard_cadence"] == ws2["nosync_noreshard_fsdp2"]
    assert ws2["nosync_noreshard_cadence_parity"] <= TOL
