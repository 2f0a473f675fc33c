"""Building and proving a schedule costs work proportional to its actions.

Every rank builds (generate + lower) and proves (validate + simulate) its schedule
at start-up and at every elastic restart, so the cost must grow with the number of
actions, not with actions x ranks. Nothing here reads a clock: the work is counted
(Python calls, simulator steps), and the simulator's incremental matching is
checked against the full scan it replaced, which is its definition.
"""

from __future__ import annotations

import random
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadence.pipeline.schedule import (
    SCHEDULE_NAMES,
    Action,
    ActionKind,
    Schedule,
    channel_plan,
    generate,
    lower,
    simulate,
    verify,
)
from cadence.pipeline.schedule import sim as sim_module

pytestmark = pytest.mark.torch_free

# Sizes 4x apart in actions (p and m both doubled); the allowance over 4x covers
# the log factor of sorting; the full scan the simulator used to do per step
# (work growing as actions x ranks) measured 5.2x here.
SMALL, LARGE = (4, 16), (8, 32)
GROWTH_LIMIT = 4 * 1.12


def _count_calls(fn: Callable[[], Any]) -> int:
    """Python and builtin calls made while ``fn`` runs: a clock-free measure of work."""
    calls = 0

    def tracer(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    old = sys.getprofile()
    sys.setprofile(tracer)
    try:
        fn()
    finally:
        sys.setprofile(old)
    return calls


def _pipeline(name: str, p: int, m: int) -> Callable[[], None]:
    def run() -> None:
        low = lower(generate(name, p, m))
        channel_plan(low)
        verify(low)

    return run


def _actions(name: str, p: int, m: int) -> int:
    return sum(len(acts) for acts in lower(generate(name, p, m)).ranks)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_build_and_proof_work_grows_with_the_actions(name: str) -> None:
    small, large = _actions(name, *SMALL), _actions(name, *LARGE)
    assert 3.5 < large / small < 4.5  # the sizes really are 4x apart in actions
    work_small = _count_calls(_pipeline(name, *SMALL))
    work_large = _count_calls(_pipeline(name, *LARGE))
    growth = (work_large / large) / (work_small / small) * 4
    assert growth <= GROWTH_LIMIT, (
        f"{name}: 4x the actions cost {growth:.2f}x the work (calls per action "
        f"{work_small / small:.0f} -> {work_large / large:.0f})"
    )


def _sim_counts(low: Schedule) -> Counter[str]:
    """Simulator steps and channel visits made while proving ``low``."""
    counts: Counter[str] = Counter()
    real_step, real_visit = sim_module._Sim._step, sim_module._Sim._match_channel

    def step(self: Any, r: int) -> bool:
        counts["step"] += 1
        return real_step(self, r)

    def visit(self: Any, ch: tuple[int, int]) -> bool:
        counts["visit"] += 1
        return real_visit(self, ch)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sim_module._Sim, "_step", step)
        mp.setattr(sim_module._Sim, "_match_channel", visit)
        verify(low)
    return counts


def test_the_simulator_steps_and_visits_each_channel_a_bounded_number_of_times() -> None:
    # The proof's inner loop: per action at most a couple of steps and channel visits,
    # whatever the number of ranks (the full scan visited every channel per step).
    for p, m in (SMALL, LARGE, (16, 64)):
        low = lower(generate("interleaved", p, m))
        counts = _sim_counts(low)
        n = sum(len(acts) for acts in low.ranks)
        assert counts["step"] / n < 1.5 and counts["visit"] / n < 1.5, (p, counts, n)


# -- the incremental matching equals the full scan --------------------------------


def _full_scan_simulate(sched: Schedule, **kw: Any) -> Any:
    """The simulator with every channel scanned on every match: the reference."""
    with pytest.MonkeyPatch.context() as mp:
        real_init = sim_module._Sim.__init__

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            real_init(self, *args, **kwargs)
            self.scan_all = True

        mp.setattr(sim_module._Sim, "__init__", init)
        return simulate(sched, **kw)


def _outcome(fn: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("ok", fn())
    except Exception as e:  # the verdict is part of what must agree
        return ("error", type(e).__name__, str(e), getattr(e, "cycle", None))


def _mutate(sched: Schedule, rng: random.Random) -> Schedule:
    """Move, drop or wrap a few actions: schedules that deadlock or mismatch, too."""
    rows = [list(acts) for acts in sched.ranks]
    for _ in range(rng.randint(0, 3)):
        r = rng.randrange(len(rows))
        if len(rows[r]) < 2:
            continue
        i = rng.randrange(len(rows[r]) - 1)
        what = rng.random()
        if what < 0.6:
            rows[r].insert(min(len(rows[r]) - 1, i + rng.randint(1, 6)), rows[r].pop(i))
        elif what < 0.7:
            del rows[r][i]
        else:
            a = rows[r][i]
            if a.kind is ActionKind.SEND:  # a blocking send: SEND + WAIT_SEND
                rows[r].insert(i + 1, replace(a, kind=ActionKind.WAIT_SEND, channel=None, seq=None))
            else:
                rows[r].insert(i, Action(ActionKind.BARRIER, 0))
    return sched.with_ranks(rows)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(SCHEDULE_NAMES),
    p=st.integers(2, 4),
    extra=st.integers(0, 6),
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(["shared", "per_direction", "per_directed_edge"]),
    serialize=st.booleans(),
    eager=st.sampled_from([0, 1, 2]),
)
def test_incremental_matching_equals_the_full_scan(
    name: str, p: int, extra: int, seed: int, mode: str, serialize: bool, eager: int
) -> None:
    m = (2 * p if name == "dualpipev" else p) + extra
    sched = _mutate(lower(generate(name, p, m)), random.Random(seed))
    kw: dict[str, Any] = {"mode": mode, "serialize": serialize}
    kw.update({"send": "eager", "eager": eager} if eager else {"send": "rendezvous"})
    assert _outcome(lambda: simulate(sched, **kw)) == _outcome(
        lambda: _full_scan_simulate(sched, **kw)
    )
