"""A greedy list scheduler for V-shaped zero-bubble orders.

`greedy_v` runs a unit-time simulation in which each free rank picks, among its
ready actions, an input gradient first (it is on the critical path), then the
forward nearest the V's turn, then a W. It packs few-microbatch schedules tighter
than the phase construction of ZBV; `zero_bubble.zbv` uses it where it is no
worse (see [Note: choosing among candidate orders] there). Because it only ever
emits an action whose inputs are done in its own time model, the order is
dependency-consistent by construction.
"""

from __future__ import annotations

from cadence.pipeline.schedule.ir import Action, ActionKind, Schedule
from cadence.pipeline.schedule.orders import make_schedule, v_placement

__all__ = ["greedy_v"]

F, I, W = ActionKind.F, ActionKind.I, ActionKind.W  # noqa: E741
_Key = tuple[ActionKind, int, int]


def greedy_v(p: int, m: int) -> Schedule:
    """The greedy ZBV order for p ranks and m microbatches (unit-time actions).

    Forwards of the first chunk are capped at 2p chunk activations per rank, the
    smallest cap that keeps rank 0 busy until its first gradient returns (2p - 1
    chunk hops); a second-chunk forward is never capped, since it is what lets a
    microbatch turn and free memory.
    """
    placement = v_placement(p)
    n = len(placement)
    done: dict[_Key, int] = {}  # -> finish time
    todo: list[set[_Key]] = [set() for _ in range(p)]
    for s in range(n):
        for k in range(m):
            todo[placement[s]] |= {(F, s, k), (I, s, k), (W, s, k)}
    rows: list[list[Action]] = [[] for _ in range(p)]
    busy, live = [0] * p, [0] * p

    def ready(a: _Key, t: int) -> bool:
        kind, s, k = a
        if kind is F:
            deps = [(F, s - 1, k)] if s > 0 else []
        elif kind is I:
            deps = [(F, s, k)] + ([(I, s + 1, k)] if s + 1 < n else [])
        else:
            deps = [(I, s, k)]
        return all(done.get(d, t + 1) <= t for d in deps)

    t, limit = 0, 3 * n * m * 4
    while any(todo):
        if t > limit:  # every step runs at least one action unless the cap starved all
            raise RuntimeError(f"greedy_v(p={p}, m={m}) made no progress (a generator bug)")
        for r in range(p):
            if busy[r] > t:
                continue
            cand = [a for a in todo[r] if ready(a, t)]
            order = (
                sorted((a for a in cand if a[0] is I), key=lambda a: (a[2], a[1]))
                + sorted(
                    (a for a in cand if a[0] is F and (a[1] >= p or live[r] < 2 * p)),
                    key=lambda a: (-a[1], a[2]),
                )
                + sorted((a for a in cand if a[0] is W), key=lambda a: (a[2], a[1]))
            )
            if not order:
                continue
            choice = order[0]
            todo[r].discard(choice)
            done[choice] = busy[r] = t + 1
            live[r] += {F: 1, I: 0, W: -1}[choice[0]]
            rows[r].append(Action(*choice))
        t += 1
    return make_schedule("zbv", rows, placement, 2, m)
