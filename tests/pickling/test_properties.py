"""Hypothesis: random nests of closures behave the same after a round trip."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence import pickling
from tests.pickling._harness import PROTOCOLS

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free

# Hypothesis and function-scoped fixtures do not mix: the protocols are a parametrization.
per_protocol = pytest.mark.parametrize("protocol", PROTOCOLS, ids=[f"p{p}" for p in PROTOCOLS])

# A nest is built from a plan: each level closes over a constant, optionally over the
# previous level (a chain), optionally shares a mutable cell with a sibling, and has
# defaults and attributes.
level = st.fixed_dictionaries(
    {
        "const": st.integers(-100, 100),
        "default": st.integers(0, 5),
        "chain": st.booleans(),
        "shared": st.booleans(),
        "tag": st.one_of(st.none(), st.text(max_size=5), st.frozensets(st.text(max_size=3))),
    }
)


def _level(spec, prev):
    const, chain, shared = spec["const"], spec["chain"], spec["shared"]
    counter = [0]

    def f(x, d=spec["default"], *, mul=2):
        total = x * mul + const + d
        if chain and prev is not None:
            total += prev(x)
        if shared:
            counter[0] += 1
            total += counter[0]
        return total

    def peek():
        return counter[0]

    if spec["tag"] is not None:
        f.tag = spec["tag"]
    f.peek = peek
    return f


def build(plan):
    funcs = []
    prev = None
    for spec in plan:
        prev = _level(spec, prev)
        funcs.append(prev)
    return funcs


@per_protocol
@settings(max_examples=25, deadline=None)
@given(st.lists(level, min_size=1, max_size=6), st.integers(-10, 10))
def test_closure_nests_round_trip(protocol, plan, x):
    original = build(plan)
    expected = build(plan)  # a twin, so calling it does not disturb `original`
    loaded = pickle.loads(pickling.dumps(original, protocol=protocol))
    for f_orig, f_new in zip(expected, loaded):
        assert f_new(x) == f_orig(x)
        assert f_new(x, 1, mul=3) == f_orig(x, 1, mul=3)
        # The cell shared by f and f.peek stays shared after loading.
        assert f_new.peek() == f_orig.peek()
        assert getattr(f_new, "tag", None) == getattr(f_orig, "tag", None)


@per_protocol
@settings(max_examples=40, deadline=None)
@given(
    st.recursive(
        st.one_of(st.integers(), st.text(max_size=4), st.none(), st.floats(allow_nan=False)),
        lambda kids: st.one_of(
            st.lists(kids, max_size=4),
            st.tuples(kids, kids),
            st.frozensets(st.text(max_size=3), max_size=4),
            st.dictionaries(st.text(max_size=3), kids, max_size=3),
        ),
        max_leaves=20,
    )
)
def test_plain_data_matches_the_standard_pickler(protocol, value):
    def make():
        return lambda: value

    assert pickle.loads(pickling.dumps(value, protocol=protocol)) == value
    assert pickle.loads(pickling.dumps(make(), protocol=protocol))() == value
