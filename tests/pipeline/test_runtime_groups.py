"""Channel groups: the digest vote, canonical creation order, preconnect, divergence."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch.distributed as dist

from cadence import EventLog
from cadence.pipeline.groups import PlanMismatchError, build_channel_groups, canonical_rounds
from cadence.testing import run_distributed

LOOP4 = [(0, 1), (1, 2), (2, 3), (3, 0), (1, 0), (2, 1), (3, 2), (0, 3)]


def _digest(channels) -> str:
    return hashlib.sha256(repr(sorted(channels)).encode()).hexdigest()


def test_canonical_rounds_match_upstream_loop_golden():
    rng = random.Random(0)
    shuffled = LOOP4[:]
    rng.shuffle(shuffled)
    assert canonical_rounds(shuffled) == [
        [(0, 1), (2, 3)],
        [(1, 0), (3, 2)],
        [(0, 3), (1, 2)],
        [(3, 0), (2, 1)],
    ]


def _body_groups(seed: int):
    rank = dist.get_rank()
    chans = LOOP4[:]
    random.Random(seed + rank).shuffle(chans)  # a different input order on every rank
    calls = []
    real = dist.new_group

    def spy(*a, **k):
        calls.append(tuple(k.get("ranks", a[0] if a else ())))
        return real(*a, **k)

    dist.new_group = spy
    try:
        log = EventLog()
        cg = build_channel_groups(
            chans, pp_ranks=[0, 1, 2, 3], digest=_digest(chans), event_log=log
        )
        # a second build with the same plan hits the cache: no new group, no preconnect
        n = len(calls)
        build_channel_groups(chans[::-1], pp_ranks=[0, 1, 2, 3], digest=_digest(chans))
        assert len(calls) == n
    finally:
        dist.new_group = real
    p2p = sorted((e.kind, e.group) for e in log.collectives() if e.kind in ("send", "recv"))
    return calls, sorted(cg.groups), p2p


def _body_diverge():
    rank = dist.get_rank()
    chans = [(0, 1), (1, 0)] if rank == 0 else [(0, 1)]
    try:
        build_channel_groups(chans, pp_ranks=[0, 1], digest=_digest(chans))
    except PlanMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_groups_world4_same_order_every_rank_and_preconnected():
    out = run_distributed(_body_groups, 7, world_size=4, timeout=60)
    calls = [c for c, _, _ in out]
    assert all(c == calls[0] for c in calls), calls
    assert len(calls[0]) == 8
    for rank, (_, mine, p2p) in enumerate(out):
        assert mine == sorted(ch for ch in LOOP4 if rank in ch)
        # exactly one preconnect message per channel this rank is on
        assert len(p2p) == len(mine)


def test_divergent_plan_fails_fast_on_every_rank():
    out = run_distributed(_body_diverge, world_size=2, timeout=30)
    for msg in out:
        assert "plans differ" in msg and "only on rank" in msg, msg
