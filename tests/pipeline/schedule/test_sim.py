"""Simulator oracles: theory bubbles, FIFO, rendezvous, serialisation, memory."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from cadence.pipeline.schedule import (
    GENERATORS,
    FifoMismatchError,
    Schedule,
    ScheduleDeadlockError,
    ScheduleValidationError,
    TimeModel,
    add_comms,
    apply_parity_rule,
    chrome_trace,
    generate,
    lower,
    simulate,
    verify,
)

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free

GRID = [(p, k * p) for p in (2, 4, 8) for k in (1, 2, 4)]


def _frac(x: float) -> Fraction:
    return Fraction(x).limit_denominator(10_000)


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_gpipe_1f1b_equals_theory(name: str, p: int, m: int) -> None:
    r = verify(lower(generate(name, p, m)))
    assert r.makespan == 3 * (m + p - 1)
    assert _frac(r.bubble) == Fraction(p - 1, m + p - 1)


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("name", ["interleaved", "looped_bfs"])
def test_bubble_interleaved_equals_theory(name: str, p: int, m: int) -> None:
    v = 2
    r = verify(lower(generate(name, p, m, v)))
    assert _frac(r.bubble) == Fraction(p - 1, v * m + p - 1)


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("v", [1, 2])
def test_bubble_zb_h1_equals_theory(v: int, p: int, m: int) -> None:
    # Bubble per rank (p-1)(t_F + t_B - t_W)/v at t_F = t_I = t_W = 1 per stage.
    r = verify(lower(generate("zb_h1", p, m, v)))
    assert _frac(r.makespan) == 3 * m + Fraction(p - 1, v)
    assert _frac(r.bubble) == Fraction(p - 1, 3 * v * m + p - 1)


def test_makespans_p4_m8() -> None:
    got = {
        n: verify(lower(generate(n, 4, 8, v))).makespan
        for n, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("looped_bfs", 2), ("zb_h1", 2)]
    }
    assert got == {
        "gpipe": 33.0,
        "1f1b": 33.0,
        "interleaved": 28.5,
        "looped_bfs": 28.5,
        "zb_h1": 25.5,
    }
    # ZBV: the makespan of torch's own ZBV IR replayed here (test_torch_interop.py).
    assert verify(lower(generate("zbv", 4, 8))).makespan == 25.5


@pytest.mark.parametrize("p", [2, 4, 8])
def test_memory_bounds(p: int) -> None:
    m = 2 * p
    assert verify(lower(generate("1f1b", p, m))).peak_inflight == tuple(p - r for r in range(p))
    assert verify(lower(generate("gpipe", p, m))).peak_inflight == (m,) * p


def test_fifo_swap_is_rejected() -> None:
    s = Schedule.from_lists(
        [["0F0", "0SEND_F0", "0F1", "0SEND_F1"], ["1RECV_F1", "1RECV_F0", "1F0", "1F1"]]
    )
    with pytest.raises(
        FifoMismatchError, match=r"FIFO mismatch on channel \(0->1\), seq 0: expected 1F1 got 1F0"
    ):
        simulate(s)


# Two ranks that each do a blocking send (SEND + WAIT_SEND) before their receive.
_SEND_SEND = [
    ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0WAIT_SEND_F1", "2RECV_F0", "2F0"],
    ["1RECV_F0", "1F0", "1SEND_F0", "1WAIT_SEND_F0", "1RECV_F1", "1F1"],
]


def test_send_send_deadlock_rejected_under_rendezvous_accepted_eager() -> None:
    s = Schedule.from_lists(_SEND_SEND, placement=[0, 1, 0, 1])
    with pytest.raises(ScheduleDeadlockError) as e:
        simulate(s, send="rendezvous")
    msg = str(e.value)
    assert "wait-for cycle: rank 0 -[0WAIT_SEND_F1" in msg and "rank 1 -[1WAIT_SEND_F0" in msg
    assert "first blocked action per rank:" in msg and "  rank 1: action 3 1WAIT_SEND_F0" in msg
    assert {c[0] for c in e.value.cycle} == {0, 1}
    simulate(s, send="eager", eager=1)


# pytorch/pytorch#172668: naive deferred receives on a 2-rank looped schedule.
_NAIVE_DEFERRED = [
    ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "2RECV_F0", "2F0"],
    ["1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1", "1F1"],
]


def test_172668_naive_deferred_recv_rejected_parity_rule_accepted() -> None:
    s = Schedule.from_lists(_NAIVE_DEFERRED, placement=[0, 1, 0, 1])
    with pytest.raises(ScheduleDeadlockError, match="wait-for cycle"):
        simulate(s, mode="shared", serialize=True)
    fixed = apply_parity_rule(s)
    assert [str(a) for a in fixed.ranks[0]][-3:] == ["2RECV_F0", "0SEND_F1", "2F0"]
    simulate(fixed, mode="shared", serialize=True)


def test_195760_cross_edge_deadlock_per_mode() -> None:
    # 8 stages on 4 ranks (loop), skewed start, each RECV posted just before its
    # consumer (add_comms alone): shared and per-direction communicators couple
    # unrelated edges into a cycle; per directed edge does not.
    naive = add_comms(generate("interleaved", 4, 8, 2))
    skew = TimeModel(start_delay=(0.0, 0.7, 1.3, 0.2))
    for mode in ("shared", "per_direction"):
        with pytest.raises(ScheduleDeadlockError) as e:
            simulate(naive, mode=mode, serialize=True, time=skew)
        assert e.value.cycle and "communicator" in str(e.value)
    ok = verify(naive, mode="per_directed_edge", time=skew)
    assert ok.makespan > 28.5
    # The global message order of lower() runs under every layout, same makespan.
    low = lower(generate("interleaved", 4, 8, 2))
    for mode in ("shared", "per_direction", "per_directed_edge"):
        assert verify(low, mode=mode, time=skew).makespan == ok.makespan


_GRID = [
    (name, p, m, v)
    for name in GENERATORS
    for p in (2, 3, 4, 8)
    for m in sorted({1, p - 1, p + 1, 2 * p} | ({3 * p} if p < 8 else set()))
    for v in (
        (1,) if name in ("gpipe", "1f1b") else (2, 3) if name in ("interleaved", "zb_h1") else (2,)
    )
    if not (name == "dualpipev" and m < 2 * p)
]


def test_lowered_generators_run_under_every_communicator_layout() -> None:
    # Every generator over the grid: deadlock-free with per-edge, per-direction and
    # one shared communicator, with rendezvous sends and serialised communicators,
    # at equal costs and with W cheap plus a skewed start.
    cheap_skewed = TimeModel(w=0.25, start_delay=(0.0, 0.9, 0.3, 1.7, 0.2, 0.0, 1.1, 0.4))
    failures = []
    for name, p, m, v in _GRID:
        low = lower(generate(name, p, m, v))
        for mode in ("per_directed_edge", "per_direction", "shared"):
            for time in (None, cheap_skewed):
                if time is not None and p == 8:
                    continue  # the orders do not depend on time; keep the test short
                try:
                    simulate(low, mode=mode, serialize=True, time=time)
                except ScheduleDeadlockError:
                    failures.append((name, p, m, v, mode))
    assert not failures, failures
    assert len(_GRID) > 150


def test_verify_refuses_compute_only() -> None:
    with pytest.raises(ScheduleValidationError, match="run lower"):
        verify(generate("1f1b", 2, 2))


def test_bad_simulator_arguments() -> None:
    low = lower(generate("1f1b", 2, 2))
    with pytest.raises(ScheduleValidationError, match="mode must be one of"):
        simulate(low, mode="ring")  # type: ignore[arg-type]
    with pytest.raises(ScheduleValidationError, match="send must be"):
        simulate(low, send="lazy")  # type: ignore[arg-type]
    with pytest.raises(ScheduleValidationError, match=r"TimeModel.f must be >= 0"):
        TimeModel(f=-1)


# A BARRIER waits for every send its rank issued so far (as the runtime does).
_BARRIERS = [
    ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0BARRIER", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
    ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1BARRIER", "1RECV_F1", "1F1", "1B1", "1SEND_B1"],
]


def test_barrier_waits_for_this_ranks_sends() -> None:
    # Each rank's barrier waits on a send whose receive the peer posts after its own
    # barrier: a cycle under rendezvous sends, fine once sends are buffered.
    s = Schedule.from_lists(_BARRIERS, placement=[0, 1])
    with pytest.raises(
        ScheduleDeadlockError, match=r"rank 0: action 4 0BARRIER: waiting on 0SEND_F1"
    ):
        simulate(s)
    simulate(s, send="eager", eager=2)
    simulate(Schedule.from_lists([[a for a in r if "BARRIER" not in a] for r in _BARRIERS]))


def test_time_model_comm_and_trace() -> None:
    low = lower(generate("1f1b", 2, 4))
    r = simulate(low, time=TimeModel(alpha=0.5, message_bytes=100, beta=100))
    assert r.makespan > 15.0
    tr = chrome_trace(r)
    kinds = {e["ph"] for e in tr["traceEvents"]}
    assert {"X", "s", "f"} <= kinds
    json.dumps(tr)
    assert "bubble" in r.summary()
