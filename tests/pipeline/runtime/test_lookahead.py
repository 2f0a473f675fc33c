"""Receive lookahead: which receives are posted when, and the refusals (no process group)."""

from __future__ import annotations

import pytest

from cadence.pipeline.runtime import PipelineUsageError
from cadence.pipeline.runtime.lookahead import check_lookahead, recv_plan
from cadence.pipeline.schedule import ActionKind, generate, lower


def _channel(a):
    return (a.peer_stage, a.stage)


def test_plan_keeps_each_channel_in_order_and_k_ahead():
    acts = lower(generate("1f1b", 2, 4, 1)).ranks[1]  # receives activations from rank 0
    recvs = [i for i, a in enumerate(acts) if a.kind is ActionKind.RECV]
    assert len(recvs) == 4
    assert recv_plan(acts, 0, _channel) is None  # 0: every RECV posted where it stands
    plan = recv_plan(acts, 1, _channel)
    assert plan.at_start == (recvs[0],)
    for pos, i in enumerate(recvs):
        assert plan.on_reach[i] == tuple(recvs[pos : pos + 2])
    plan = recv_plan(acts, 10, _channel)
    assert plan.at_start == tuple(recvs)


def test_plan_separates_channels():
    acts = lower(generate("interleaved", 2, 4, 2)).ranks[0]  # keyed here by payload
    plan = recv_plan(acts, 1, lambda a: (a.peer_stage % 2, a.payload))
    channels = {(acts[i].peer_stage % 2, acts[i].payload) for i in plan.at_start}
    assert len(channels) == len(plan.at_start) > 1


def test_defaults_and_refusals():
    assert check_lookahead(None, "per_directed_edge", False) == 1
    assert check_lookahead(None, "per_direction", False) == 0
    assert check_lookahead(None, "shared", False) == 0
    assert check_lookahead(None, "per_directed_edge", True) == 0
    assert check_lookahead(0, "shared", True) == 0
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(PipelineUsageError, match="use an int >= 0"):
            check_lookahead(bad, "per_directed_edge", False)  # type: ignore[arg-type]
    with pytest.raises(PipelineUsageError, match="one global message order"):
        check_lookahead(2, "shared", False)
    with pytest.raises(PipelineUsageError, match="one global message order"):
        check_lookahead(1, "per_direction", False)
    with pytest.raises(PipelineUsageError, match="use one of the two"):
        check_lookahead(1, "per_directed_edge", True)
