"""cadence's phases as ``torch.profiler`` ranges; the scenarios are in ``bodies_profiler``."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from cadence.comm import phase
from tests._scenarios import Outcomes, check, launched, names
from tests.foundation.bodies_profiler import SCENARIOS


@pytest.fixture(scope="module")
def outcomes() -> Outcomes:
    return launched("tests.foundation.bodies_profiler", world_size=2, timeout=120)


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_profiler_ranges(outcomes: Outcomes, name: str) -> None:
    check(outcomes, name)


class _Unformattable:
    """A range's detail that fails if anything formats it."""

    def __format__(self, spec: str) -> str:
        raise AssertionError("a phase's name was formatted with no profiler running")

    def __str__(self) -> str:
        return self.__format__("")


def test_no_range_is_made_or_named_without_a_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    # A record_function costs its enter and exit even with no profiler; cadence's
    # phases sit on the critical path of every bucket launch and pipeline action.
    def refused(*_: object, **__: object) -> None:
        raise AssertionError("record_function was made with no profiler running")

    monkeypatch.setattr(torch.profiler, "record_function", refused)
    with phase("pp.", _Unformattable()):
        pass


def test_a_range_is_named_with_its_detail_under_a_profiler() -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof, phase("pp.", "1F0"):
        torch.ones(2).add_(1)
    assert "cadence::pp.1F0" in {e.key for e in prof.key_averages()}
