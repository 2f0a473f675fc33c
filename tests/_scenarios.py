"""Named scenarios that assert themselves, several to one launch, one pytest test each.

A scenario is a module-level function run on every rank: it computes and checks what
it computed beside the computation (plain ``assert`` with a message, `assert_raises`
for an error), and returns nothing. `Scenario` binds one to a name and arguments.

Process start-up dominates a distributed test, so one launch runs many scenarios:
`run_scenarios` runs them in turn on every rank and keeps each one's traceback text
by name (``None`` when it passed), so one failing scenario does not stop the others
(FSDP2's ``run_subtests`` in spirit). The test module merges the ranks' maps with
`merged` and has one test per scenario, `check`, which fails with that scenario's own
traceback. The ranks run the same scenarios in the same order, so collectives stay
matched; a scenario that fails between collectives on some ranks only leaves the
others waiting, and the launch's timeout then fails every test of the launch.
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import cadence

Outcomes = dict[str, "str | None"]


@dataclass(frozen=True)
class Scenario:
    """``fn(**kwargs)`` under ``name`` (a test id: the function's name, then its case)."""

    name: str
    fn: Callable[..., None]
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self) -> None:
        self.fn(**self.kwargs)


def scenarios(*fns: Callable[[], None]) -> list[Scenario]:
    """One scenario per function, named after it."""
    return [Scenario(fn.__name__, fn) for fn in fns]


def cases(fn: Callable[..., None], param: str, values: Iterable[Any]) -> list[Scenario]:
    """``fn(param=v)`` for each value, named ``fn-v``."""
    return [Scenario(f"{fn.__name__}-{v}", fn, {param: v}) for v in values]


def names(items: Sequence[Scenario]) -> list[str]:
    found = [s.name for s in items]
    if len(set(found)) != len(found):
        raise ValueError(f"scenario names repeat: {sorted(found)}")
    return found


def run_scenarios(items: Sequence[Scenario]) -> Outcomes:
    """Run each scenario; ``{name: None}`` if it passed, else its traceback text."""
    names(items)
    out: Outcomes = {}
    for s in items:
        try:
            s.fn(**s.kwargs)
        except Exception as exc:
            # From the scenario's own frame on: this loop's frame says nothing.
            tb = exc.__traceback__.tb_next if exc.__traceback__ else None
            out[s.name] = "".join(traceback.format_exception(type(exc), exc, tb))
        else:
            out[s.name] = None
    return out


def run_module_scenarios(module: str, attr: str = "SCENARIOS") -> Outcomes:
    """`run_scenarios` on ``module.attr`` (a launch target that pickles by name)."""
    return run_scenarios(getattr(importlib.import_module(module), attr))


def launched(module: str, attr: str = "SCENARIOS", *, world_size: int, timeout: float) -> Outcomes:
    """One launch in which every rank runs ``module.attr``'s scenarios; the merged map."""
    from cadence.testing import run_distributed

    per_rank = run_distributed(
        run_module_scenarios, module, attr, world_size=world_size, timeout=timeout
    )
    return merged(per_rank)


def merged(per_rank: Sequence[Outcomes]) -> Outcomes:
    """One map for all ranks: ``None`` where every rank passed, else each failure's text."""
    out: Outcomes = {}
    for name in per_rank[0]:
        failures = [f"--- rank {rank} ---\n{o[name]}" for rank, o in enumerate(per_rank) if o[name]]
        out[name] = "\n".join(failures) if failures else None
    return out


def check(outcomes: Outcomes, name: str) -> None:
    """Fail the calling test with scenario ``name``'s traceback, if it failed."""
    import pytest

    if name not in outcomes:
        pytest.fail(f"scenario {name} did not run (ran: {sorted(outcomes)})", pytrace=False)
    if outcomes[name] is not None:
        pytest.fail(f"scenario {name} failed:\n{outcomes[name]}", pytrace=False)


def assert_raises(
    fn: Callable[[], object],
    *fragments: str,
    kind: type[BaseException] = cadence.CadenceError,
) -> BaseException:
    """Assert ``fn()`` raises ``kind`` with every fragment in its message; return the error.

    Another exception propagates unchanged (and fails the scenario with its traceback).
    """
    try:
        fn()
    except kind as exc:
        missing = [f for f in fragments if f not in str(exc)]
        assert not missing, f"{kind.__name__} message lacks {missing}: {exc}"
        return exc
    raise AssertionError(f"no {kind.__name__} raised (expected one naming {list(fragments)})")
