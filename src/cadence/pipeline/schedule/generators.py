"""Schedule generators: compute-only per-rank action lists for the classic schedules.

Every generator returns a compute-only `Schedule` (F/B/I/W, FB_OVERLAP for
DualPipeV). ``passes.lower`` turns it into what the runtime executes. The closed
forms (GPipe, 1F1B, Interleaved 1F1B, LoopedBFS) live here, the zero-bubble family
in ``zero_bubble.py``, the pieces they share in ``orders.py``; this module also
holds the registry of names.

[Note: the generated IR is what runs]
There is no hand-written execution loop anywhere in cadence whose IR would only be
a picture. torch (2.13, and still 2.15) runs GPipe and 1F1B as hand-written loops
and keeps an IR beside them for the visualiser, and that IR drifted:
``Schedule1F1B``'s order for the last rank of p=4, m=8 reads ``3F1, 3B0, 3F2, ...,
3F8, 3B7`` (forward indices shifted by one, microbatch 8 out of range), which the
validator rejects with "B before F". Executing the generated list itself means the
simulator, the pictures and the runtime all see the same schedule.
"""

from __future__ import annotations

from collections.abc import Callable

from cadence.pipeline.schedule._errors import ScheduleValidationError
from cadence.pipeline.schedule.ir import Action, ActionKind, Schedule
from cadence.pipeline.schedule.orders import (
    check_sizes,
    depth_first,
    loop_placement,
    make_schedule,
    microbatch_groups,
    v_placement,
)
from cadence.pipeline.schedule.zero_bubble import dualpipev, zb_h1, zbv

__all__ = [
    "GENERATORS",
    "SCHEDULE_NAMES",
    "canonical_name",
    "default_chunks",
    "dualpipev",
    "generate",
    "gpipe",
    "interleaved_1f1b",
    "loop_placement",
    "looped_bfs",
    "one_f_one_b",
    "placement_for",
    "torch_schedule_name",
    "v_placement",
    "zb_h1",
    "zbv",
]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741


# -- closed-form orders ---------------------------------------------------------


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """All forwards, then all backwards (full B), one stage per rank."""
    check_sizes(p, m)
    if v != 1:
        raise ScheduleValidationError("gpipe has one stage per rank; use looped_bfs for v > 1")
    rows = [
        [Action(F, r, k) for k in range(m)] + [Action(B, r, k) for k in range(m)] for r in range(p)
    ]
    return make_schedule("gpipe", rows, loop_placement(p, 1), 1, m)


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B (PipeDream-Flush): p-1-r warm-up forwards, then F/B pairs, then the rest.

    Rank r holds at most p - r activations. The last rank starts with F0, B0; see
    [Note: the generated IR is what runs].
    """
    check_sizes(p, m)
    if v != 1:
        raise ScheduleValidationError("1f1b has one stage per rank; use interleaved_1f1b for v > 1")
    rows = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        row = [Action(F, r, k) for k in range(warm)]
        for i in range(m - warm):
            row += [Action(F, r, warm + i), Action(B, r, i)]
        row += [Action(B, r, k) for k in range(m - warm, m)]
        rows.append(row)
    return make_schedule("1f1b", rows, loop_placement(p, 1), 1, m)


def _interleaved_order(p: int, m: int, v: int, r: int) -> list[Action]:
    # Megatron's depth-first order over microbatch groups (see [Note: microbatch
    # groups]): warm-up 2(p-1-r) + (v-1) * (first group) chunk forwards, then 1F1B
    # over chunks, then the remaining backwards.
    fwd, bwd = depth_first(p, m, v, r)
    total = v * m
    warm = min(2 * (p - 1 - r) + (v - 1) * microbatch_groups(m, p)[0], total)
    row = [Action(F, *fwd[k]) for k in range(warm)]
    for i in range(total - warm):
        row += [Action(F, *fwd[warm + i]), Action(B, *bwd[i])]
    row += [Action(B, *bwd[k]) for k in range(total - warm, total)]
    return row


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B with v chunks per rank, loop placement (stage s on s % p), any m."""
    check_sizes(p, m, v)
    rows = [_interleaved_order(p, m, v, r) for r in range(p)]
    return make_schedule("interleaved", rows, loop_placement(p, v), v, m)


def looped_bfs(p: int, m: int, v: int = 2) -> Schedule:
    """Breadth-first: every microbatch through a local stage before the next stage."""
    check_sizes(p, m, v)
    rows = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        row = [Action(F, s, k) for s in stages for k in range(m)]
        row += [Action(B, s, k) for s in reversed(stages) for k in range(m)]
        rows.append(row)
    return make_schedule("looped_bfs", rows, loop_placement(p, v), v, m)


GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "looped_bfs": looped_bfs,
    "zb_h1": zb_h1,
    "zbv": zbv,
    "dualpipev": dualpipev,
}
_ALIASES = {
    "interleaved1f1b": "interleaved",
    "interleaved_1f1b": "interleaved",
    "loopedbfs": "looped_bfs",
    "zbh1": "zb_h1",
    "zb1p": "zb_h1",
    "interleaved_zb": "zb_h1",
    "interleavedzerobubble": "zb_h1",
    "zb_v": "zbv",
    "zbvzerobubble": "zbv",
    "dualpipe_v": "dualpipev",
    "one_f_one_b": "1f1b",
}
_DEFAULT_V = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved": 2,
    "looped_bfs": 2,
    "zb_h1": 1,
    "zbv": 2,
    "dualpipev": 2,
}


# Canonical names -> torch pipelining's class names (``get_schedule_class``), for
# running torch's own lowered IR and for comparing against torch in tests.
_TORCH_NAMES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "zb_h1": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
SCHEDULE_NAMES = tuple(GENERATORS)
_V_SHAPED = frozenset({"zbv", "dualpipev"})


def canonical_name(name: str) -> str:
    """The generator key for a schedule name or alias (``Interleaved1F1B`` -> ``interleaved``)."""
    key = name.lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in GENERATORS:
        raise ScheduleValidationError(
            f"unknown schedule {name!r}; choose one of {', '.join(GENERATORS)}"
        )
    return key


def generate(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """A named generator's compute-only schedule (``v`` defaults per schedule)."""
    key = canonical_name(name)
    return GENERATORS[key](p, m, _DEFAULT_V[key] if v is None else v)


def default_chunks(name: str) -> int:
    """Stages per rank (v) a schedule uses when none is given: 1 or 2."""
    return _DEFAULT_V[canonical_name(name)]


def torch_schedule_name(name: str) -> str:
    """torch pipelining's class name for a schedule name or alias (``zbv`` -> ``ZBVZeroBubble``)."""
    return _TORCH_NAMES[canonical_name(name)]


def placement_for(name: str, pp: int, chunks: int) -> dict[int, int]:
    """stage -> pipeline rank of a named schedule: V for ZBV/DualPipeV, else loop.

    The same placement the generator emits, without generating the schedule.
    """
    if canonical_name(name) in _V_SHAPED:
        if chunks != 2:
            raise ScheduleValidationError(f"{name} is V-shaped and needs chunks=2, got {chunks}")
        return dict(enumerate(v_placement(pp)))
    return dict(enumerate(loop_placement(pp, chunks)))
