"""The foundation's launches: every body that needs a world size shares one launch.

Process start-up dominates the cost of a small body, so world 3 runs the collectives
and the timing verbs (3 ranks also give fully_shard uneven shards), and world 4 the
topology groups and the meaning of ``group=`` (a 2 x 2 layout).
"""

from __future__ import annotations

from typing import Any

import cadence
from tests.foundation.bodies_comm import collectives
from tests.foundation.bodies_timing import timing_verbs
from tests.foundation.bodies_topology import group_meaning, topology_groups

__all__ = ["world3", "world4"]


def world3() -> dict[str, Any]:
    return {"collectives": collectives(3), "timing": timing_verbs()}


def world4() -> dict[str, Any]:
    pg = cadence.init(cadence.Topology(dp_replicate=2, dp_shard=2))
    return {"groups": topology_groups(pg), "meaning": group_meaning(pg)}
