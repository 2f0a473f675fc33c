"""Rank bodies: how `Topology.build` creates its groups (cadence/topology.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import cadence
from cadence.topology import can_split
from tests._group_spy import spy_groups


def build_counting(dp_replicate: int, dp_shard: int, pp: int) -> dict[str, Any]:
    """Build a topology with ``new_group`` and ``split_group`` counted; then check each
    group by an all-reduce of the ranks."""
    with spy_groups() as spy:
        groups = cadence.Topology(dp_replicate=dp_replicate, dp_shard=dp_shard, pp=pp).build()
    calls = {name: spy.calls.count(name) for name in ("new_group", "split_group")}
    out: dict[str, Any] = {"calls": calls, "can_split": can_split()}
    for name in ("pp", "dp_replicate", "dp_shard", "dp"):
        group = getattr(groups, name)
        t = torch.tensor([float(groups.rank)])
        dist.all_reduce(t, group=group)
        out[name] = (dist.get_world_size(group), float(t))
    out["dp_is_dp_shard"] = groups.dp is groups.dp_shard
    out["pp_is_world"] = groups.pp is dist.group.WORLD
    return out
