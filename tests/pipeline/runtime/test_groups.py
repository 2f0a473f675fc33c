"""Channel groups: the plan vote, canonical creation order, preconnect, divergence.

Specification: every rank creates the same groups in the same order whatever order
it listed its channels in; each channel moves exactly one preconnect message
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
    calls = [c for c, _, _ in out]
    assert all(c == calls[0] for c in calls), calls
    assert len(calls[0]) == 8
    for rank, (_, mine, p2p) in enumerate(out):
        assert mine == sorted(ch for ch in LOOP4 if rank in ch)
        # exactly one preconnect message per channel this rank is on
        assert len(p2p) == len(mine)
