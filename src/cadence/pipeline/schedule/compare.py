"""cadence's generators side by side with torch pipelining's, in cadence's simulator.

What ``cadence schedule compare`` prints. Both orders are compute-only lists, lowered
by the same `lower` and run by the same `simulate`, so the table compares the
orders and nothing else:

- ``makespan`` at equal costs (F = I = W = 1 per full stage, full B = 2) and with
  W at half the cost of I (``cheap W``: F = I = 1, W = 0.5), the case zero-bubble
  orders are usually tuned for and a fixed order can lose most in;
- ``peak``: the most chunk activations alive at once on any rank (an F adds one,
  a B or W frees one), the rank that runs out of memory first;
- ``bubble``: idle / (p x makespan) at equal costs.

torch is needed only for its side: `torch_order` imports
``torch.distributed.pipelining`` when called, and everything else here is pure.
torch's ``Schedule1F1B`` (2.13 and 2.15) keeps an IR beside its execution loop
that is invalid on the last rank (see [Note: the generated IR is what runs]); the
table says so instead of timing it. torch's compute-only lists carry its reduction
actions (REDUCE_GRAD after a stage's last backward; from torch 2.15 GPipe's and
1F1B's also a WAIT_REDUCE_GRAD right after it); `lower` replaces both with its
own, so both orders are timed with the same reduction placement on either torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cadence.pipeline.schedule._errors import ScheduleValidationError
from cadence.pipeline.schedule.generators import (
    canonical_name,
    generate,
    placement_for,
    torch_schedule_name,
)
from cadence.pipeline.schedule.ir import Schedule
from cadence.pipeline.schedule.passes import lower
from cadence.pipeline.schedule.sim import TimeModel, simulate

__all__ = [
    "CHEAP_W",
    "EQUAL_COSTS",
    "CompareRow",
    "OrderMetrics",
    "compare",
    "default_grid",
    "format_table",
    "order_metrics",
    "torch_order",
]

EQUAL_COSTS = TimeModel()
CHEAP_W = TimeModel(f=1.0, i=1.0, w=0.5)


@dataclass(frozen=True)
class OrderMetrics:
    """One order's numbers: makespans under both cost models, peak, bubble."""

    makespan: float
    makespan_cheap_w: float
    peak: int
    bubble: float

    def no_worse_than(self, other: OrderMetrics, tol: float = 1e-9) -> bool:
        return (
            self.makespan <= other.makespan + tol
            and self.makespan_cheap_w <= other.makespan_cheap_w + tol
            and self.peak <= other.peak
        )


@dataclass(frozen=True)
class CompareRow:
    """cadence's and torch's numbers for one (schedule, p, m, v); ``torch`` is a
    string saying why there is no number (torch refuses, or its IR is invalid)."""

    name: str
    p: int
    m: int
    v: int
    cadence: OrderMetrics
    torch: OrderMetrics | str


def order_metrics(sched: Schedule) -> OrderMetrics:
    """Lower a compute-only order and simulate it under both cost models."""
    low = lower(sched)
    eq = simulate(low, time=EQUAL_COSTS)
    cheap = simulate(low, time=CHEAP_W)
    return OrderMetrics(eq.makespan, cheap.makespan, max(eq.peak_inflight), eq.bubble)


def torch_order(name: str, p: int, m: int, v: int) -> Schedule | str:
    """The installed torch's compute-only order in cadence's IR, or why torch has none.

    Raises ImportError where torch (or its pipelining package) is not installed.
    """
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    try:
        ops = get_schedule_ops(torch_schedule_name(name), p, m, v)
    except (ValueError, AssertionError) as e:
        return f"torch refuses: {str(e).splitlines()[0][:60]}"
    rows = [[str(a) for a in ops[r] if a is not None] for r in range(p)]
    return Schedule.from_lists(
        rows, placement_for(name, p, v), generator=f"torch:{name}", v=v, m=m, lowered=False
    )


def default_grid(p: int) -> tuple[int, ...]:
    """Microbatch counts compared for p ranks: below, at and around multiples of p."""
    return tuple(sorted({1, max(1, p - 1), p, p + 1, 2 * p, 2 * p + 1, 3 * p}))


def _torch_metrics(name: str, p: int, m: int, v: int) -> OrderMetrics | str:
    order = torch_order(name, p, m, v)
    if isinstance(order, str):
        return order
    try:
        return order_metrics(order)
    except ScheduleValidationError as e:
        return f"torch IR invalid: {str(e).splitlines()[0][:60]}"


def compare(
    names: Iterable[str],
    ps: Sequence[int],
    ms: Sequence[int] | None = None,
    *,
    chunks: int | None = None,
) -> list[CompareRow]:
    """Rows for every (schedule, p, m) of the grid.

    ``ms=None`` uses `default_grid` per p. ``chunks`` is v for the schedules with
    several stages per rank (default 2; torch's interleaved zero bubble needs
    v >= 2, so ZB-H1 is compared at v=2 unless told otherwise). A configuration
    cadence refuses (DualPipeV needs m >= 2p) is left out when torch refuses it too.
    """
    rows = []
    for name in names:
        key = canonical_name(name)
        if key in ("gpipe", "1f1b"):
            v = 1
        elif key in ("zbv", "dualpipev"):
            v = 2
        else:
            v = chunks or 2
        for p in ps:
            for m in ms if ms is not None else default_grid(p):
                theirs = _torch_metrics(key, p, m, v)
                try:
                    ours = order_metrics(generate(key, p, m, v))
                except ScheduleValidationError:
                    if isinstance(theirs, str):
                        continue
                    raise
                rows.append(CompareRow(key, p, m, v, ours, theirs))
    return rows


def format_table(rows: Sequence[CompareRow]) -> str:
    """A fixed-width table, one line per row; ``<=`` when cadence is no worse, and a
    closing count."""
    head = (
        f"{'schedule':<12}{'p':>3}{'m':>4}{'v':>3}  "
        f"{'makespan':>17}  {'cheap W':>17}  {'peak':>9}  {'bubble':>13}  verdict"
    )
    sub = f"{'':<22}  {'cadence / torch':>17}  {'cadence / torch':>17}  {'cad/torch':>9}  {'cad / torch':>13}"
    lines = [head, sub]
    for row in rows:
        c, t = row.cadence, row.torch
        lead = f"{row.name:<12}{row.p:>3}{row.m:>4}{row.v:>3}  "
        if isinstance(t, str):
            lines.append(
                lead
                + f"{c.makespan:>8g} / {'-':<6}  {c.makespan_cheap_w:>8g} / {'-':<6}  "
                + f"{c.peak:>4} / {'-':<2}  {c.bubble:>6.3f} / {'-':<4}  {t}"
            )
            continue
        verdict = "<=" if c.no_worse_than(t) else "WORSE"
        lines.append(
            lead
            + f"{c.makespan:>8g} / {t.makespan:<6g}  {c.makespan_cheap_w:>8g} / {t.makespan_cheap_w:<6g}  "
            + f"{c.peak:>4} / {t.peak:<2}  {c.bubble:>6.3f} / {t.bubble:<5.3f}  {verdict}"
        )
    timed = [r for r in rows if not isinstance(r.torch, str)]
    ok = sum(r.cadence.no_worse_than(r.torch) for r in timed)  # type: ignore[arg-type]  # timed holds no str rows
    lines.append(
        f"cadence no worse than torch (both makespans and peak) in {ok} of {len(timed)} "
        "configurations torch generates a valid order for"
    )
    return "\n".join(lines)
