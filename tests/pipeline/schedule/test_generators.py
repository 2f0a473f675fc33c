"""Every generator's output validates, lowers and passes the simulator."""

from __future__ import annotations

import pytest

from cadence.pipeline.schedule import (
    GENERATORS,
    ActionKind,
    ScheduleValidationError,
    add_reduce_grad,
    add_wait_reduce,
    default_chunks,
    generate,
    lower,
    microbatch_groups,
    placement_for,
    torch_schedule_name,
    verify,
)

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free

CASES = [
    (n, p, m)
    for n in GENERATORS
    for p in (2, 4)
    for m in (p, 2 * p)
    if not (n == "dualpipev" and m < 2 * p)
]


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_generator_lowers_and_verifies(name: str, p: int, m: int) -> None:
    low = lower(generate(name, p, m))
    verify(low)
    # every cross-rank transfer has a channel and a sequence number
    for acts in low.ranks:
        for a in acts:
            if a.kind in (ActionKind.SEND, ActionKind.RECV):
                assert a.channel is not None and a.seq is not None


def test_reduce_grad_after_last_backward_and_wait_before_next() -> None:
    low = lower(generate("interleaved", 2, 4), reduce_grad=False)
    low = add_wait_reduce(add_reduce_grad(low))
    kinds = [(a.kind.name, a.stage) for a in low.ranks[0] if "REDUCE" in a.kind.name]
    assert kinds == [
        ("REDUCE_GRAD", 2),
        ("WAIT_REDUCE_GRAD", 2),
        ("REDUCE_GRAD", 0),
        ("WAIT_REDUCE_GRAD", 0),
    ]
    acts = list(low.ranks[0])
    i = acts.index(next(a for a in acts if a.kind is ActionKind.REDUCE_GRAD))
    assert acts[i - 1].kind is ActionKind.B and acts[i - 1].stage == 2
    assert not any(a.kind is ActionKind.B and a.stage == 2 for a in acts[i:])


def test_dualpipev_uses_overlap_and_v_turn_is_local() -> None:
    low = lower(generate("dualpipev", 4, 8))
    assert any(a.kind is ActionKind.FB_OVERLAP for r in low.ranks for a in r)
    assert not any(
        a.kind is ActionKind.SEND and a.stage in (3, 4) and a.peer_stage in (3, 4)
        for r in low.ranks
        for a in r
    )


@pytest.mark.parametrize("name", ["interleaved", "zb_h1"])
@pytest.mark.parametrize(("p", "m"), [(4, 6), (4, 9), (3, 7), (4, 2), (8, 17)])
def test_looped_schedules_accept_any_microbatch_count(name: str, p: int, m: int) -> None:
    sched = generate(name, p, m, 2)
    result = verify(lower(sched))
    # Every rank does all its work: 2 chunks x m microbatches x (F + I + W) at 1/2 each.
    assert all(b == 3 * m for b in result.busy)
    # Memory is bounded by the warm-up (one group per chunk plus the hops back),
    # not by m chunks per rank.
    hops = 2 * (p - 1) if name == "interleaved" else p - 1
    assert max(result.peak_inflight) <= 2 * microbatch_groups(m, p)[0] + hops + 1


def test_microbatch_groups_split_evenly() -> None:
    assert microbatch_groups(8, 4) == [4, 4]
    assert microbatch_groups(9, 4) == [5, 4]
    assert microbatch_groups(11, 4) == [6, 5]
    assert microbatch_groups(3, 4) == [3]


def test_generator_argument_errors() -> None:
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        generate("zbv", 2, 4, 3)
    with pytest.raises(ValueError, match="unknown schedule"):
        generate("nope", 2, 2)


def test_placement_for_matches_the_generated_schedule() -> None:
    for name in GENERATORS:
        v = default_chunks(name)
        assert tuple(placement_for(name, 4, v).values()) == generate(name, 4, 8, v).placement
    # Looped: the wrap-around 3 -> 4 is rank 3 -> rank 0, a SEND on channel (3, 0).
    low = lower(generate("interleaved", 4, 8, 2))
    assert any(a.kind is ActionKind.SEND and a.channel == (3, 0) for a in low.ranks[3])
    with pytest.raises(ValueError, match="needs chunks=2"):
        placement_for("zbv", 4, 1)
    assert torch_schedule_name("Interleaved1F1B") == "Interleaved1F1B"
    assert torch_schedule_name("zb1p") == "InterleavedZeroBubble"


def test_wait_reduce_keeps_at_most_k_in_flight() -> None:
    low = lower(generate("interleaved", 2, 4, 2), max_outstanding_reductions=2)
    kinds = [(a.kind.name, a.stage) for a in low.ranks[0] if "REDUCE" in a.kind.name]
    assert kinds == [
        ("REDUCE_GRAD", 2),
        ("REDUCE_GRAD", 0),
        ("WAIT_REDUCE_GRAD", 2),
        ("WAIT_REDUCE_GRAD", 0),
    ]
    verify(low)
    with pytest.raises(ScheduleValidationError, match="max_outstanding must be an int >= 1"):
        lower(generate("interleaved", 2, 4, 2), max_outstanding_reductions=0)
