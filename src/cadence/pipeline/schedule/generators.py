"""Schedule generators: compute-only per-rank action lists for the classic schedules.

Every generator returns a compute-only `Schedule` (F/B/I/W, FB_OVERLAP for
DualPipeV). ``passes.lower`` turns it into what the runtime executes.

[Note: the generated IR is what runs]
There is no hand-written execution loop anywhere in cadence whose IR would only be
a picture. torch 2.13 runs GPipe and 1F1B as hand-written loops and keeps an IR
beside them for the visualiser, and that IR drifted: ``Schedule1F1B``'s order for
the last rank of p=4, m=8 reads ``3F1, 3B0, 3F2, ..., 3F8, 3B7`` (forward indices
shifted by one, microbatch 8 out of range), which the validator rejects with "B
before F". Executing the generated list itself means the simulator, the pictures
and the runtime all see the same schedule.

Two construction styles:
- closed-form orders (GPipe, 1F1B, Interleaved 1F1B, LoopedBFS), written down
  directly from their definitions;
- a unit-time list scheduler (`_list_schedule`) for the zero-bubble family, which
  places W (weight-gradient) actions into the idle slots of a fixed F/I order
  (ZB-H1) or picks among ready actions by priority (ZBV, DualPipeV). Because it
  only ever emits an action whose inputs are done in its own unit-time model, the
  result is dependency-consistent by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cadence.pipeline.schedule.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleMeta,
    ScheduleValidationError,
)

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


def loop_placement(p: int, v: int) -> tuple[int, ...]:
    """Stage s on rank s % p (interleaved, LoopedBFS, ZB-H1)."""
    return tuple(s % p for s in range(p * v))


def v_placement(p: int) -> tuple[int, ...]:
    """Two chunks per rank in a V: 0..p-1 then p-1..0 (ZBV, DualPipeV)."""
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


def _check(p: int, m: int, v: int = 1) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ScheduleValidationError(f"need p >= 1, m >= 1, v >= 1; got p={p}, m={m}, v={v}")


def _make(
    name: str, rows: Sequence[Sequence[Action]], placement: tuple[int, ...], v: int, m: int
) -> Schedule:
    meta = ScheduleMeta(generator=name, p=len(rows), v=v, m=m, lowered=False)
    return Schedule(placement, tuple(tuple(r) for r in rows), meta)


# -- closed-form orders ---------------------------------------------------------


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """All forwards, then all backwards (full B), one stage per rank."""
    _check(p, m)
    if v != 1:
        raise ScheduleValidationError("gpipe has one stage per rank; use looped_bfs for v > 1")
    rows = [
        [Action(F, r, k) for k in range(m)] + [Action(B, r, k) for k in range(m)] for r in range(p)
    ]
    return _make("gpipe", rows, loop_placement(p, 1), 1, m)


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B (PipeDream-Flush): p-1-r warm-up forwards, then F/B pairs, then the rest.

    Rank r holds at most p - r activations. The last rank starts with F0, B0; see
    [Note: the generated IR is what runs].
    """
    _check(p, m)
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
    return _make("1f1b", rows, loop_placement(p, 1), 1, m)


def _interleaved_order(p: int, m: int, v: int, r: int, backward: ActionKind) -> list[Action]:
    # Megatron's depth-first order: microbatches go in groups of p; within a group
    # every local chunk runs before the next group. Warm-up is
    # 2(p-1-r) + (v-1)p chunk forwards, then 1F1B over chunks.
    if m % p:
        raise ScheduleValidationError(
            f"interleaved schedules need m divisible by p (groups of p microbatches); "
            f"got m={m}, p={p}. Use m={((m + p - 1) // p) * p} or looped_bfs"
        )
    total = v * m

    def fwd(k: int) -> Action:
        g, w = divmod(k, p * v)
        return Action(F, (w // p) * p + r, g * p + w % p)

    def bwd(k: int) -> Action:
        g, w = divmod(k, p * v)
        return Action(backward, (v - 1 - w // p) * p + r, g * p + w % p)

    # Megatron runs all forwards first when m == p (full B only: with an I/W split
    # the regular warm-up leaves less idle time).
    regular = min(2 * (p - 1 - r) + (v - 1) * p, total)
    warm = total if (m == p and backward is B) else regular
    row = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        row += [fwd(warm + i), bwd(i)]
    row += [bwd(k) for k in range(total - warm, total)]
    return row


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B with v chunks per rank, loop placement (stage s on s % p)."""
    _check(p, m, v)
    rows = [_interleaved_order(p, m, v, r, B) for r in range(p)]
    return _make("interleaved", rows, loop_placement(p, v), v, m)


def looped_bfs(p: int, m: int, v: int = 2) -> Schedule:
    """Breadth-first: every microbatch through a local stage before the next stage."""
    _check(p, m, v)
    rows = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        row = [Action(F, s, k) for s in stages for k in range(m)]
        row += [Action(B, s, k) for s in reversed(stages) for k in range(m)]
        rows.append(row)
    return _make("looped_bfs", rows, loop_placement(p, v), v, m)


# -- list scheduler for the zero-bubble family -----------------------------------

_Pick = Callable[[int, list[Action], dict], Action | None]


def _list_schedule(
    placement: tuple[int, ...],
    m: int,
    pick: _Pick,
    *,
    durations: dict[ActionKind, int] | None = None,
) -> list[list[Action]]:
    """Unit-time greedy scheduler: each free rank runs ``pick(rank, ready, state)``.

    ``ready`` lists the rank's not-yet-run actions whose inputs are done (F after
    F of the previous stage; I/B after F of the same stage and I/B of the next;
    W after I). ``pick`` returns one of them (or an FB_OVERLAP of two) or None.
    """
    dur = {F: 1, I: 1, W: 1, B: 2, **(durations or {})}
    n, p = len(placement), max(placement) + 1
    done: dict[tuple[ActionKind, int, int], int] = {}  # -> finish time
    todo: dict[int, set[tuple[ActionKind, int, int]]] = {r: set() for r in range(p)}
    for s in range(n):
        for k in range(m):
            todo[placement[s]] |= {(F, s, k), (I, s, k), (W, s, k)}
    rows: list[list[Action]] = [[] for _ in range(p)]
    busy = [0] * p
    state: dict = {"inflight": [0] * p, "pending_w": [0] * p}

    def is_ready(a: tuple[ActionKind, int, int], t: int) -> bool:
        kind, s, k = a
        deps: list[tuple[ActionKind, int, int]] = []
        if kind is F and s > 0:
            deps = [(F, s - 1, k)]
        elif kind in (I, B):
            deps = [(F, s, k)] + ([(I, s + 1, k)] if s + 1 < n else [])
        elif kind is W:
            deps = [(I, s, k)]
        for d in deps:
            f = done.get(d)
            if f is None or f > t:
                return False
        return True

    t = 0
    limit = 50 * (n * m * 3 + 10)
    while any(todo.values()):
        if t > limit:
            raise RuntimeError("list scheduler made no progress (a generator bug)")
        for r in range(p):
            if busy[r] > t or not todo[r]:
                continue
            ready = sorted(
                (a for a in todo[r] if is_ready(a, t)), key=lambda a: (a[2], a[1], a[0].value)
            )
            choice = pick(r, [Action(*a) for a in ready], state)
            if choice is None:
                continue
            length = 0
            # A full B stands for its I and W (DualPipeV's overlapped backward).
            keys = []
            for part in choice.compute_parts():
                kinds = (I, W) if part.kind is B else (part.kind,)
                keys += [(kd, part.stage, part.mb) for kd in kinds]
                length += dur[part.kind]
            busy[r] = t + length
            for key in keys:
                todo[r].discard(key)  # type: ignore[arg-type]
                done[key] = t + length  # type: ignore[index]
            for part in choice.compute_parts():
                if part.kind is F:
                    state["inflight"][r] += 1
                elif part.kind in (B, W):
                    state["inflight"][r] -= 1
                if part.kind is I:
                    state["pending_w"][r] += 1
                elif part.kind is W:
                    state["pending_w"][r] -= 1
            rows[r].append(choice)
        t += 1
    return rows


def zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 (v=1) / interleaved zero bubble (v >= 2): the (interleaved) 1F1B order
    with B split into I and W, and each W moved into the first slot where the next
    F/I is not ready yet (or to the end). This reaches the ZB-H1 bubble exactly at
    equal durations, but W's deferred to the end keep their activations alive: peak
    memory on rank 0 is up to m chunk activations, above ZB-H1's 1F1B level (a known
    gap: a memory-capped variant loses bubble with this F/I order).
    """
    _check(p, m, v)
    orders = {
        r: (_interleaved_order(p, m, v, r, I) if v > 1 else one_f_one_b(p, m).ranks[r])
        for r in range(p)
    }
    if v == 1:
        orders = {
            r: [Action(I, a.stage, a.mb) if a.kind is B else a for a in o]
            for r, o in orders.items()
        }
    pos = [0] * p

    def pick(r: int, ready: list[Action], state: dict) -> Action | None:
        nxt = orders[r][pos[r]] if pos[r] < len(orders[r]) else None
        ws = [a for a in ready if a.kind is W]
        if ws and nxt is None:
            return ws[0]
        if nxt is not None and nxt in ready:
            pos[r] += 1
            return nxt
        return ws[0] if ws else None

    rows = _list_schedule(loop_placement(p, v), m, pick)
    return _make("zb_h1", rows, loop_placement(p, v), v, m)


def _v_pick(p: int, *, overlap: bool) -> _Pick:
    # Priority for V schedules: input-gradients first (they are on the critical
    # path), then forwards of the later chunk (closer to the turn), then earlier
    # chunk forwards under an in-flight cap of 2p chunk activations, then W to
    # fill what is left. The cap 2p is the smallest that keeps rank 0 busy until
    # its first gradient returns (2p-1 chunk hops); 2(p-r) stalls the pipeline
    # (p=4, m=8: makespan 47 against 25.5).
    def pick(r: int, ready: list[Action], state: dict) -> Action | None:
        bs = sorted((a for a in ready if a.kind in (I, B)), key=lambda a: (a.mb, a.stage))
        fs = sorted((a for a in ready if a.kind is F), key=lambda a: (-a.stage, a.mb))
        ws = [a for a in ready if a.kind is W]
        # Only first-chunk forwards are capped: a second-chunk forward is what
        # lets the microbatch turn and free memory, so capping it could stall.
        if overlap and bs and fs:
            # Overlapping frees as much as it allocates, so the cap does not apply.
            f = fs[0]
            b = Action(B, bs[0].stage, bs[0].mb)
            if f.stage != b.stage:
                return Action(ActionKind.FB_OVERLAP, f.stage, f.mb, sub=(f, b))
        fs = [a for a in fs if a.stage >= p or state["inflight"][r] < 2 * p]
        room = bool(fs)
        if bs:
            b = bs[0]
            return (
                Action(B, b.stage, b.mb) if (overlap and b.kind is I and not ws and not fs) else b
            )
        if fs and room:
            return fs[0]
        return ws[0] if ws else None

    return pick


def zbv(p: int, m: int, v: int = 2) -> Schedule:
    """ZB-V: two chunks per rank in a V (the turn is a LOCAL hand-off), I/W split."""
    _check(p, m)
    if v != 2:
        raise ScheduleValidationError(f"zbv is V-shaped with exactly 2 chunks per rank, got v={v}")
    rows = _list_schedule(v_placement(p), m, _v_pick(p, overlap=False))
    return _make("zbv", rows, v_placement(p), 2, m)


def dualpipev(p: int, m: int, v: int = 2) -> Schedule:
    """DualPipeV: V placement; in steady state a forward of one chunk is paired with
    a full backward of the other as one FB_OVERLAP action.
    """
    _check(p, m)
    if v != 2:
        raise ScheduleValidationError(
            f"dualpipev is V-shaped with exactly 2 chunks per rank, got v={v}"
        )
    if m < 2 * p:
        raise ScheduleValidationError(f"dualpipev needs m >= 2p microbatches (got m={m}, p={p})")
    rows = _list_schedule(v_placement(p), m, _v_pick(p, overlap=True))
    return _make("dualpipev", rows, v_placement(p), 2, m)


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
