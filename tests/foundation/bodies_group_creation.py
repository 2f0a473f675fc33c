"""Rank bodies: how `Topology.build` creates its groups (cadence/topology.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import cadence
from cadence.topology import can_split


def build_counting(dp_replicate: int, dp_shard: int, pp: int) -> dict[str, Any]:
    """Build a topology with ``new_group`` and ``split_group`` counted; then check each
    group by an all-reduce of the ranks."""
    calls = {"new_group": 0, "split_group": 0}
    originals = {name: getattr(dist, name) for name in calls}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in calls:
        setattr(dist, name, counted(name))
    try:
        groups = cadence.Topology(dp_replicate=dp_replicate, dp_shard=dp_shard, pp=pp).build()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    out: dict[str, Any] = {"calls": calls, "can_split": can_split()}
    for name in ("pp", "dp_replicate", "dp_shard", "dp"):
        group = getattr(groups, name)
        t = torch.tensor([float(groups.rank)])
        dist.all_reduce(t, group=group)
        out[name] = (dist.get_world_size(group), float(t))
    out["dp_is_dp_shard"] = groups.dp is groups.dp_shard
    out["pp_is_world"] = groups.pp is dist.group.WORLD
    return out
