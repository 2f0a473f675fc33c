"""HSDP 2 x 2 at world 4, and DCP resharding world 2 -> 4 -> 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.fsdp.bodies_world4 import dcp_load_body, hsdp_body

TOL = 1e-6


@pytest.fixture(scope="module")
def w4(world2: list[dict[str, Any]], dcp_dir: Path) -> dict[str, Any]:
    saved = world2[0]["dcp_saved"]  # the world-2 run saved to dcp_dir / "ws2"
    ranks = run_distributed(
        hsdp_body, str(dcp_dir / "ws2"), str(dcp_dir / "ws4"), world_size=4, timeout=150
    )
    back = run_distributed(dcp_load_body, str(dcp_dir / "ws4"), world_size=2, timeout=90)[0]
    out = dict(ranks[0])
    out["dcp_ws2_saved"] = saved
    out["dcp_ws2_back"] = back
    out["dcp_ws4_rank3_rows"] = ranks[3]["dcp_ws4_local_rows"]
    out["dcp_ws4_all_ranks"] = [r["dcp_ws4_outputs"] for r in ranks]
    return out


@pytest.mark.parametrize(
    ("mode", "counts"),
    [
        ("every", [(7, 4, 4)] * 4),
        ("nosync", [(7, 0, 0), (7, 4, 4)] * 2),
        ("deferred_sync", [(7, 0, 0)] * 4),
        ("deferred_async", [(7, 0, 0)] * 4),
        # Manual mode: an all-reduce is issued when its reduce-scatter retires; with one
        # reduction in flight (the default), three retire during backward, one in finalize.
        ("manual_sync_last", [(7, 0, 0), (7, 4, 3)] * 2),
        # HSDP replicas exchange one all-reduce per unit per accumulation window.
        ("no_all_reduce", [(7, 4, 0), (7, 4, 4)] * 2),
    ],
)
def test_hsdp_2x2_parity_and_counts(w4: dict[str, Any], mode: str, counts: list[Any]) -> None:
    assert w4[f"hsdp_{mode}_parity"] <= TOL
    assert w4[f"hsdp_{mode}_counts"] == counts


def test_hsdp_placements(w4: dict[str, Any]) -> None:
    assert w4["hsdp_placements"] == "(Replicate(), Shard(dim=0))"


def test_dcp_world2_to_world4_and_back(w4: dict[str, Any]) -> None:
    # Linear(8, 7) at world 4: ranks hold 2, 2, 2, 1 rows (uneven resharding).
    assert w4["dcp_ws4_rank3_rows"] == 1
    assert w4["dcp_ws4_outputs"] == w4["dcp_ws2_saved"]
    assert all(o == w4["dcp_ws2_saved"] for o in w4["dcp_ws4_all_ranks"])
    assert w4["dcp_ws2_back"] == w4["dcp_ws2_saved"]
