"""Rank bodies of the channel-group tests."""

from __future__ import annotations

import random

import torch.distributed as dist

from cadence import EventLog
from cadence.pipeline.runtime import PlanMismatchError, build_channel_groups
from cadence.pipeline.schedule import ChannelPlan
from cadence.topology import can_split, subgroup_timeout
from tests._group_spy import spy_groups

LOOP4 = [(0, 1), (1, 2), (2, 3), (3, 0), (1, 0), (2, 1), (3, 2), (0, 3)]


def body_groups(seed: int):
    """Every rank builds the loop plan from a differently shuffled channel list."""
    rank = dist.get_rank()
    chans = LOOP4[:]
    random.Random(seed + rank).shuffle(chans)  # a different input order on every rank
    with spy_groups() as spy:
        log = EventLog()
        plan = ChannelPlan.build(chans, placement=(0, 1, 2, 3))
        cg = build_channel_groups(plan, pp_ranks=[0, 1, 2, 3], event_log=log)
        # a second build with the same plan hits the cache: no new group, no preconnect
        n = len(spy.calls)
        again = ChannelPlan.build(chans[::-1], placement=(0, 1, 2, 3))
        build_channel_groups(again, pp_ranks=[0, 1, 2, 3])
        assert len(spy.calls) == n
    p2p = sorted((e.kind, e.group) for e in log.collectives() if e.kind in ("send", "recv"))
    return {
        "spy": spy,
        "can_split": can_split(),
        "rounds": len(plan.rounds),
        "mine": sorted({ch for ch, _ in cg.groups}),
        "p2p": p2p,
        # [Note: subgroups wait as long as the world]: every channel group's timeout.
        "timeouts": sorted({str(subgroup_timeout(g)) for g in cg.groups.values()}),
        "world_timeout": str(subgroup_timeout()),
    }


def body_diverge():
    """Rank 0 plans one more channel than rank 1: both raise before any group."""
    rank = dist.get_rank()
    chans = [(0, 1), (1, 0)] if rank == 0 else [(0, 1)]
    try:
        build_channel_groups(ChannelPlan.build(chans, placement=(0, 1)), pp_ranks=[0, 1])
    except PlanMismatchError as e:
        return str(e)
    return "no error"
