"""Channel derivation goldens, plan determinism, digest and differences."""

from __future__ import annotations

import random
import re

import pytest

from cadence.pipeline.schedule import (
    ChannelPlan,
    Schedule,
    ScheduleValidationError,
    channel_plan,
    derive_channels,
    describe_plan_difference,
    generate,
    logical_edges,
    lower,
    plan_rounds,
)

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free

LOOP_ROUNDS = (((0, 1), (2, 3)), ((1, 0), (3, 2)), ((0, 3), (1, 2)), ((3, 0), (2, 1)))


def test_loop_placement_eight_edges_four_rounds() -> None:
    low = lower(generate("interleaved", 4, 8, 2))
    assert low.placement == (0, 1, 2, 3, 0, 1, 2, 3)
    plan = channel_plan(low)
    assert len(plan.edges) == 8 and plan.rounds == LOOP_ROUNDS
    assert sum(len(v) for v in logical_edges(low).values()) == 14


def test_v_placement_six_edges_no_wrap_no_turn() -> None:
    low = lower(generate("zbv", 4, 8))
    assert low.placement == (0, 1, 2, 3, 3, 2, 1, 0)
    assert set(derive_channels(low)) == {(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2)}
    turns = [a for a in low.ranks[3] if a.kind.name == "LOCAL"]
    assert len(turns) == 2 * 8  # the turn, both directions, every microbatch


def test_two_rank_v() -> None:
    assert derive_channels(lower(generate("zbv", 2, 4))) == ((0, 1), (1, 0))


def test_skip_connection_adds_a_channel() -> None:
    # A synthetic skip edge: stage 0's activation also goes to stage 2 (rank 2).
    s = Schedule.from_lists(
        [["0F0", "0SEND_F0~2"], ["1F0"], ["2RECV_F0~0"]], placement=[0, 1, 2], lowered=True
    )
    assert (0, 2) in derive_channels(s)


def test_plan_is_independent_of_input_order() -> None:
    edges = list(derive_channels(lower(generate("interleaved", 4, 8))))
    digests = set()
    for seed in range(5):
        random.Random(seed).shuffle(edges)
        assert plan_rounds(edges) == LOOP_ROUNDS
    # The plan's digest is a function of the schedule: built twice, the same. A schedule
    # on the same channels (LoopedBFS: the same looped placement) plans the same rounds,
    # but its messages come in another order, which the digest covers.
    for _ in range(2):
        digests.add(channel_plan(lower(generate("interleaved", 4, 8))).digest)
    assert len(digests) == 1 and len(next(iter(digests))) == 64
    bfs = lower(generate("looped_bfs", 4, 8))
    assert set(derive_channels(bfs)) == set(edges)
    assert plan_rounds(list(derive_channels(bfs))) == LOOP_ROUNDS
    assert channel_plan(bfs).digest not in digests


def test_digest_same_for_shuffled_rank_dict_order() -> None:
    low = lower(generate("interleaved", 4, 8))
    rows = {r: list(a) for r, a in enumerate(low.ranks)}
    keys = list(rows)
    random.Random(1).shuffle(keys)
    again = Schedule.from_lists(
        {k: rows[k] for k in keys}, placement=dict(reversed(list(enumerate(low.placement))))
    )
    assert channel_plan(again).digest == channel_plan(low).digest


def test_digest_covers_the_action_lists() -> None:
    # Same placement and channels, different microbatch count: the vote must see it.
    a = channel_plan(lower(generate("1f1b", 2, 2)))
    b = channel_plan(lower(generate("1f1b", 2, 4)))
    assert (a.edges, a.rounds, a.placement) == (b.edges, b.rounds, b.placement)
    assert a.digest != b.digest
    assert "the lowered action lists differ from rank 1's" in describe_plan_difference(
        a, b, their_rank=1
    )


def test_plan_from_a_channel_set() -> None:
    plan = ChannelPlan.build([(3, 0), (0, 1), (1, 0), (0, 3)], placement=(0, 1, 2, 3))
    assert plan.edges == ((0, 1), (0, 3), (1, 0), (3, 0))
    assert plan.rounds == (((0, 1),), ((1, 0),), ((0, 3),), ((3, 0),))
    assert plan == ChannelPlan.build(reversed(plan.edges), placement=(0, 1, 2, 3))
    with pytest.raises(ScheduleValidationError, match="channel mode must be one of"):
        ChannelPlan.build([], (0,), "ring")
    with pytest.raises(ScheduleValidationError, match="needs a lowered schedule"):
        channel_plan(generate("1f1b", 2, 2))


def test_plan_difference_is_described() -> None:
    a = channel_plan(lower(generate("interleaved", 4, 8)))
    b = channel_plan(lower(generate("zbv", 4, 8)))
    assert a.digest != b.digest
    text = describe_plan_difference(a, b, their_rank=2)
    assert "placement differs at stages 4 (rank 0 here, rank 3 on rank 2)" in text
    assert "channels only here: 0->3, 3->0" in text
    assert describe_plan_difference(a, a) == ""


def test_channel_modes_groups() -> None:
    low = lower(generate("interleaved", 4, 8))
    assert len(channel_plan(low, "shared").groups()) == 1
    assert len(channel_plan(low, "per_directed_edge").groups()) == 8
    # per direction: split by payload, as the simulator serialises it; the looped
    # wrap-around activation (3 -> 0) is forward traffic
    assert channel_plan(low, "per_direction").groups() == (
        ("pp_fwd", ((0, 1), (1, 2), (2, 3), (3, 0))),
        ("pp_bwd", ((0, 3), (1, 0), (2, 1), (3, 2))),
    )
    # V: the return leg sends activations to lower ranks, so both groups carry both
    v = channel_plan(lower(generate("zbv", 2, 4)), "per_direction")
    assert v.groups() == (("pp_fwd", ((0, 1), (1, 0))), ("pp_bwd", ((0, 1), (1, 0))))
    assert v.payloads == ((0, 1, "act"), (0, 1, "grad"), (1, 0, "act"), (1, 0, "grad"))


def test_per_direction_plan_needs_payloads() -> None:
    with pytest.raises(ScheduleValidationError, match="per_direction ChannelPlan needs"):
        ChannelPlan.build([(0, 1), (1, 0)], (0, 1), "per_direction")
    with pytest.raises(ScheduleValidationError, match="covering exactly its edges"):
        ChannelPlan.build([(0, 1)], (0, 1), payloads=[(1, 0, "act")])
    with pytest.raises(ScheduleValidationError, match=re.escape("(src, dst, 'act' | 'grad')")):
        ChannelPlan.build([(0, 1)], (0, 1), payloads=[(0, 1, "weights")])
