"""Channel groups: the plan vote, canonical creation order, preconnect, divergence.

Specification: every rank creates the same groups in the same order whatever order
it listed its channels in, one per directed edge (by one ``split_group`` per round
where the backend splits, else one ``new_group`` per edge); each channel moves exactly one preconnect message
before any step; a second build of the same plan reuses the cached groups. (Ranks
whose plans differ: test_step.py, in the world-2 launch.)
"""

from __future__ import annotations

import pytest

from cadence.testing import run_distributed
from tests.pipeline.runtime.bodies_groups import LOOP4, body_groups


@pytest.mark.slow
def test_groups_world4_same_order_every_rank_and_preconnected():
    out = run_distributed(body_groups, 7, world_size=4, timeout=60)
    first = out[0]["spy"]
    assert all(r["spy"] == first for r in out), [r["spy"] for r in out]
    # One group per directed edge, whichever way torch is asked for them ...
    assert sorted(first.groups) == sorted(tuple(sorted(ch)) for ch in LOOP4)
    # ... by one split per round where the backend splits, else a new_group per edge.
    if out[0]["can_split"]:
        assert first.calls == ["split_group"] * out[0]["rounds"]
    else:
        assert first.calls == ["new_group"] * len(LOOP4)
    for rank, r in enumerate(out):
        assert r["mine"] == sorted(ch for ch in LOOP4 if rank in ch)
        # exactly one preconnect message per channel this rank is on
        assert len(r["p2p"]) == len(r["mine"])
        # The world's 60 s, not torch's 30 minutes for a group made without a timeout.
        assert r["world_timeout"] == "0:01:00" and r["timeouts"] == ["0:01:00"], r
