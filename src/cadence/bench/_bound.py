"""What perfect overlap allows a whole step on an emulated link, and how close each
variant came (``cadence bench step`` on ``--link``).

[Note: the bound perfect overlap allows]
On a link, a step's communication is wire time while the cores are free. Its figures:

- ``C``, compute alone: the ``plain`` variant (the same model and batch, no
  communication), cut into ``F`` (everything before the last backward), ``B`` (the
  last backward) and ``O`` (what follows it: the optimizer, the sparse half);
- ``W``, wire time: the bytes all ranks put on the link's loopback per step (one
  queue, both directions, every rank: see `cadence.link`) over the rate the link's
  self-check measured;
- serial = ``C + W``: nothing overlapped;
- the bound: the shortest step the case's dependencies allow, with ``f`` = 1/pieces
  (buckets, units) the share of one piece, taken as equal (data-parallel buckets at
  their own shares, where the record has them):

  * data parallel (``dense``, ``recommender``, ``nanogpt_dp``), with buckets of
    shares ``s_1 .. s_n`` of the dense bytes in the order backward fills them
    (cadence's layout, which is DDP's; equal where a record lacks them) and ``S_k``
    = ``s_1 + .. + s_k``: bucket ``k`` is ready at ``r_k = F + S_k·B`` (backward's
    work taken as spread like the parameter bytes), and every byte of it and of the
    buckets after it must cross the wire after that:
    ``max(C, max_k r_k + (1 - S_(k-1))·(W - L) + L + s_n·O)``. For ``k = 1`` that
    is ``F + s_1·B + W + s_n·O`` (the wire carries ``W`` in all, from the first
    bucket on); for ``k = n`` it is ``F + B + s_n·(W - L) + L + s_n·O``: a
    synchronous step cannot hide its last bucket's reduction, which holds the first
    layers, whose gradients backward writes last; after its last byte at least its
    share of ``O`` is left. ``L`` is the wire time of an exchange that can start
    only when backward ends (``W`` includes it): the recommender's sparse one, whose
    gradient the embedding, the last thing backward computes, writes last; its
    bytes are counted apart, per variant (each variant's ``late`` call, by the same
    counter: cadence exchanges the bag's lookups, torch its rows). Its step follows
    it; that step is not timed apart and is left out. Elsewhere ``L = 0``. With
    equal shares the two ends bound every ``k`` between. Until 2026-12-07 the bound
    had only the ``k = 1`` term and ``F + B + L``, with equal shares; a record
    reads by today's rule in the report (`recomputed`), with equal shares where it
    kept none. The buckets are far from equal where the first layer is narrow: the
    recommender's last bucket holds 2.5 % of the tower's bytes (its Linear(64,
    512)), the one before it 19.5 %, ready a few milliseconds before backward
    ends. The embedding's own backward (a sparse gradient's scatter, timed at 0.4
    ms, under 0.5 % of C, at the case's size) runs after the last bucket is ready
    and is counted in ``B``: the ready times err late by at most that much there;
  * sharded (``fsdp``, ``nanogpt_fsdp``): one unit's collective ``g = f·W/3``
    (all-gather in forward, again in backward, reduce-scatter):
    ``max(g + C, g + F + B + g + f·O, W + f·O)``: no compute before the first
    all-gather lands, the last reduce-scatter only after the last backward;
  * pipeline (pp x dp): ``C`` is the pipeline without data-parallel reduction (its
    point-to-point bytes are on the wire too), ``F`` its schedule, ``O`` the
    optimizer; ``W`` counts the reduction's bytes only (the variant's bytes less
    ``plain``'s); the first stage's share ``s0`` (by parameter bytes) can start only
    after its last backward, which ends the schedule, and the last stage's only after
    its own, one backward slot ``b0`` earlier (``b0`` = 2/3 of one of the schedule's
    ``m + p - 1`` forward-and-backward slots: an estimate), on the same wire:
    ``max(C, F + s0·W + f·O, F - b0 + W + f·O)``. A deferred reduction can hide only
    in the cooldown: at rates where ``W`` dwarfs ``b0`` nearly nothing is hideable.
    That is the rule for a record that kept no ready times (before 2026-12-08). A
    record that did is read by the measured rule: each bucket ``j`` of each stage is
    ready at ``r_j``, when the last gradient it holds landed in the ``plain``
    variant (`_ready_times`; each replica's median over steps, then the later
    replica's, as an all-reduce starts only when both have issued it: which replica
    runs late changes from step to step, and each variant draws that afresh), with
    ``w_j`` its share of ``W`` by bytes. One wire serves every bucket, so no
    schedule of it ends before ``max_j (r_j + Σ_{i: r_i >= r_j} w_i)``: everything
    released at or after ``r_j`` must still cross it (Jackson's bound for one queue
    with release times).
    The queue serves the pipeline's own messages too: each replica of a stage but
    the first sends its last microbatch's input gradient when its last backward ends
    (no earlier than the latest of its buckets is ready), and that message crosses
    the same wire. Each is a job of its own, released then, its wire time the plain
    variant's bytes per message (its bytes per step over its ``2·m·(p - 1)``
    messages per replica, all of one activation's size) over the rate. Earlier
    messages left before any bucket was ready and bound nothing. After the last
    byte at least the smallest bucket's share of ``O`` is left:
    ``max(C, max_j (r_j + Σ_{r_i >= r_j} w_i) + min_j s_j·O)``. It replaces the
    three estimates of the rule above (``b0``; the last stage's buckets taken as
    ready only after its last backward; the last gradient message left out) with
    what the stages did.

Efficiency is undefined where less than a tenth of compute alone is left to hide
(serial - bound < C/10): a ratio of two small differences is noise, not a figure;
where the room is small, read the efficiency beside it (the report shows both).

The cores are a resource too. gloo moves every byte with CPU work (copies through
TCP, sums) on the same cores as the compute, so no step can be shorter than its CPU
seconds, all ranks' threads together, over the machine's cores: the CPU bound. A
variant's bound is the larger of its pattern's and its CPU bound; where the CPU bound
reaches the serial time, nothing is left to hide and the efficiency is not defined
(shown as "-": the cores, not the wire, set the step).

[Note: the cores after the last backward starts]
The whole step's CPU over the cores assumes that work could sit anywhere in the step.
It cannot: a reduction's copies and sums need the gradient it reduces, and the last
backward, the optimizer and the sparse half need the loss. The CPU a variant spends
from the start of its last backward to the step's end (``cpu_after``, every rank's
threads, measured per step at that phase mark) must fit on the cores after that
start, and that start is no earlier than compute alone reaches it (``F``, the plain
variant's). So a step takes at least ``F + cpu_after / cores``. Where communication
and compute share the cores after backward starts (data parallel: every reduction;
nanoGPT's accumulation: every reduction sits in the last of four backwards), this
binds before the whole step's CPU over the cores does, which credits the cores with
the idle time of the forward. The CPU bound is the larger of the two. Both are the
variant's own CPU on this machine: a variant with less work (less Python, fewer
copies) would have a lower one.

Each pattern bound is the same for cadence and torch: a variant that steps the
optimizer after the whole reduction (the plain loop) cannot reach it, which is part
of what the comparison shows. Overlap efficiency = (serial - measured) / (serial -
bound): 1.00 is perfect overlap, 0.00 none.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["bound_ms", "cpu_bound_ms", "efficiency", "link_figures", "recomputed"]

# Below this share of compute alone left to hide, efficiency is not defined.
MIN_HIDEABLE = 0.10


def efficiency(*, serial: float, bound: float, measured: float, compute: float) -> float | None:
    """(serial - measured) / (serial - bound), or None where nothing worth a ratio is
    left to hide (see [Note: the bound perfect overlap allows])."""
    hideable = serial - bound
    if hideable < MIN_HIDEABLE * compute:
        return None
    return (serial - measured) / hideable


_DP = ("dense", "recommender", "nanogpt_dp")
_SHARDED = ("fsdp", "nanogpt_fsdp")


def bound_ms(
    kind: str,
    *,
    c: float,
    f_: float,
    b: float,
    o: float,
    w: float,
    pieces: int,
    s0: float = 1.0,
    b0: float = 0.0,
    late: float = 0.0,
    shares: Sequence[float] | None = None,
    releases: Sequence[Sequence[float]] | None = None,
    messages: Sequence[Sequence[float]] = (),
) -> float:
    """The bound of [Note: the bound perfect overlap allows], in the unit given;
    ``late`` is ``L``, the part of ``w`` that cannot start before backward ends;
    ``shares`` the data-parallel buckets' shares of the bytes in the order backward
    fills them (equal ``pieces`` where None); ``releases`` a pipeline's buckets as
    ``(ready, share of w, share of its stage)``, which replaces ``s0`` and ``b0``,
    and ``messages`` its own last messages as ``(ready, wire time)``."""
    if not 0.0 <= late <= w:
        raise ValueError(f"late wire time {late} must be within 0 and the wire time {w}")
    f = 1.0 / max(1, pieces)
    if kind in _DP:
        return max(c, _dp_wire_bound(f_, b, o, w, late, shares or [f] * max(1, pieces)))
    if kind in _SHARDED:
        g = f * w / 3
        return max(g + c, g + f_ + b + g + f * o, w + f * o)
    if kind == "pipeline":
        if releases is not None:
            return max(c, _released_wire_bound(o, w, releases, messages))
        return max(c, f_ + s0 * w + f * o, f_ - b0 + w + f * o)
    raise ValueError(f"no bound for case kind {kind!r}")


def _released_wire_bound(
    o: float, w: float, releases: Sequence[Sequence[float]], messages: Sequence[Sequence[float]]
) -> float:
    """``max_j (r_j + Σ_{r_i >= r_j} w_i) + min_j s_j·O``: one queue's bound with
    release times (buckets and messages), then the smallest bucket's share of the
    optimizer."""
    buckets = [(float(r), float(share), float(of_stage)) for r, share, of_stage in releases]
    total = sum(share for _, share, _ in buckets)
    if not buckets or total <= 0 or any(s < 0 or not 0 < st <= 1 for _, s, st in buckets):
        raise ValueError(
            "releases must be (ready, share of the wire, share of its stage) with "
            f"non-negative shares of a positive sum and stage shares in (0, 1]: {releases}"
        )
    if any(len(m) != 2 or m[1] < 0 for m in messages):
        raise ValueError(f"messages must be (ready, non-negative wire time): {messages}")
    jobs = [(r, w * s / total) for r, s, _ in buckets] + [(float(r), float(t)) for r, t in messages]
    wire = max(r + sum(t for ri, t in jobs if ri >= r) for r, _ in jobs)
    return wire + min(st for _, _, st in buckets) * o


def _dp_wire_bound(
    f_: float, b: float, o: float, w: float, late: float, shares: Sequence[float]
) -> float:
    """``max_k r_k + (1 - S_(k-1))·(W - L) + L + s_n·O`` of the data-parallel bound."""
    total = sum(shares)
    if total <= 0 or any(x < 0 for x in shares):
        raise ValueError(f"bucket shares must be non-negative with a positive sum: {shares}")
    s = [x / total for x in shares]
    best, before = 0.0, 0.0
    for share in s:
        ready = f_ + (before + share) * b
        best = max(best, ready + (1.0 - before) * (w - late) + late + s[-1] * o)
        before += share
    return best


def recomputed(kind: str, link: dict[str, Any], variant: str) -> float:
    """A variant's pattern bound by today's rule, from the inputs a record keeps."""
    f = link[variant]
    return bound_ms(
        kind,
        c=link["compute_ms"],
        f_=link["before_ms"],
        b=link["backward_ms"],
        o=link["after_ms"],
        w=f["wire_ms"],
        pieces=int(link["pieces"]),
        s0=link.get("first_stage_share", 1.0),
        b0=link.get("cooldown_backward_ms", 0.0),
        late=f.get("late_wire_ms", 0.0),
        shares=link.get("shares"),
        releases=link.get("releases"),
        messages=link.get("messages", ()),
    )


def _phases(per_rank: list[dict[str, Any]]) -> list[float]:
    """Median of each phase, then the slowest rank's (the step is the slowest rank's)."""
    per = [[statistics.median(col) for col in zip(*r["phases"], strict=True)] for r in per_rank]
    return [max(col) for col in zip(*per, strict=True)]


def _by_stage(per_rank: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """A pipeline's ranks by their stage, stages in order."""
    out: dict[int, list[dict[str, Any]]] = {}
    for r in per_rank:
        out.setdefault(int(r["meta"]["stage"]), []).append(r)
    return dict(sorted(out.items()))


def _releases(per_rank: list[dict[str, Any]]) -> list[list[float]] | None:
    """A pipeline's buckets as ``[ready ms, share of the reduction's bytes, share of
    its stage's]``: each replica's median over steps, then the latest replica's;
    None where a rank kept no ready times."""
    if not all(r.get("releases") for r in per_rank):
        return None
    by_stage = _by_stage(per_rank)
    sizes = {s: [int(x) for x in reps[0]["meta"]["bucket_bytes"]] for s, reps in by_stage.items()}
    total = sum(sum(v) for v in sizes.values())
    out: list[list[float]] = []
    for stage, reps in by_stage.items():
        # Per replica first: which replica runs late changes from step to step (four
        # ranks share two cores), and the later of two in each step is that
        # scheduling's noise, which a variant's own steps draw afresh.
        typical = [[statistics.median(col) for col in zip(*r["releases"], strict=True)]
                   for r in reps]  # fmt: skip
        ready = [max(col) for col in zip(*typical, strict=True)]
        for r, nbytes in zip(ready, sizes[stage], strict=True):
            out.append([r, nbytes / total, nbytes / sum(sizes[stage])])
    return out


def _messages(per_rank: list[dict[str, Any]], plain_bytes: int, rate: float) -> list[list[float]]:
    """A pipeline's last input-gradient messages as ``[ready ms, wire ms]``: one per
    replica of every stage but the first, ready when that replica's last backward
    ended (the median over steps of its latest bucket), its wire time the plain
    variant's bytes per message over ``rate``."""
    meta = per_rank[0]["meta"]
    stages, replicas = int(meta["stages"]), len(per_rank) // int(meta["stages"])
    count = 2 * int(meta["microbatches"]) * (stages - 1) * replicas  # per step, all ranks
    if count <= 0:
        return []
    wire_ms = 1e3 * 8 * plain_bytes / count / rate
    return [
        [statistics.median(max(step) for step in r["releases"]), wire_ms]
        for r in per_rank
        if int(r["meta"]["stage"]) > 0
    ]


def _replica_lag(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """Per stage, how much later than the bound reads it the first bucket was ready
    on the later replica, step by step (the median over steps, ms): the wire start
    that the cores' scheduling of four ranks on two costs a reducing variant, which
    no bound built from typical ready times can hold against it."""
    out: dict[str, float] = {}
    for stage, reps in _by_stage(per_rank).items():
        firsts = [[step[0] for step in r["releases"]] for r in reps]
        typical = max(statistics.median(f) for f in firsts)
        out[str(stage)] = statistics.median(
            max(step) - typical for step in zip(*firsts, strict=True)
        )
    return out


def _cpu_seconds(per_rank: list[dict[str, Any]], variant: str, key: str = "cpu") -> float:
    """A step's CPU seconds (``key="cpu_after"``: from the start of the last backward),
    every rank's threads together, median over repetitions."""
    per_rep = [float(sum(c)) for c in zip(*(r[key][variant] for r in per_rank), strict=True)]
    return statistics.median(per_rep)


def cpu_bound_ms(
    *, cpu_ms: float, before_ms: float, cpu_after_ms: float | None, cores: int
) -> float:
    """The cores' bound of [Note: the cores after the last backward starts]: all ranks'
    CPU over the cores, or the compute before the last backward and the CPU after its
    start over the cores, whichever is larger (the first alone where a record kept no
    ``cpu_after``)."""
    whole = cpu_ms / cores
    if cpu_after_ms is None:
        return whole
    return max(whole, before_ms + cpu_after_ms / cores)


def link_figures(
    kind: str, per_rank: list[dict[str, Any]], times: dict[str, list[float]], link: Any
) -> dict[str, Any]:
    """A row's link figures: the bound's inputs, and per variant its bytes, wire time,
    serial time, bound and efficiency (all times in ms)."""
    rate = link.measured_bps or link.spec.rate_bps
    wire_bytes: dict[str, int] = per_rank[0]["wire_bytes"]
    c = 1e3 * statistics.median(times["plain"])
    phases = _phases(per_rank)
    scale = c / sum(phases) if sum(phases) > 0 else 1.0  # phases median ≠ step median
    f_, b, o = (scale * p for p in phases)
    pieces = int(per_rank[0]["meta"].get("pieces") or 1)
    shares = per_rank[0]["meta"].get("shares")
    late_bytes: dict[str, int] = per_rank[0].get("late_bytes") or {}
    s0, b0, releases, messages = 1.0, 0.0, None, []
    if kind == "pipeline":
        releases = _releases(per_rank)
        if releases is not None and rate:
            messages = _messages(per_rank, wire_bytes["plain"], rate)
        meta = per_rank[0]["meta"]
        b0 = 2 / 3 * f_ / (meta["microbatches"] + meta["stages"] - 1)
        stage_bytes = {
            s: reps[0]["meta"]["stage_param_bytes"] for s, reps in _by_stage(per_rank).items()
        }
        s0 = stage_bytes.get(0, 0) / max(1, sum(stage_bytes.values()))
    out: dict[str, Any] = {
        "rate_bps": rate,
        "compute_ms": c,
        "before_ms": f_,
        "backward_ms": b,
        "after_ms": o,
        "pieces": pieces,
        "shares": shares,
        "bytes": dict(wire_bytes),
        "late_bytes": dict(late_bytes),
    }
    if kind == "pipeline":
        out["first_stage_share"] = s0
        out["cooldown_backward_ms"] = b0
        if releases is not None:
            out["releases"] = releases
            out["messages"] = messages
            out["replica_lag_ms"] = _replica_lag(per_rank)
    for v in ("cadence", "cadence_sync", "torch", "torch_best"):
        if v not in times or rate is None:
            continue
        nbytes = wire_bytes[v] - (wire_bytes["plain"] if kind == "pipeline" else 0)
        w = 1e3 * 8 * nbytes / rate
        # The counters read both exchanges alike; a noisy read must not put more late
        # bytes than the whole step's.
        late = min(w, 1e3 * 8 * late_bytes.get(v, 0) / rate)
        serial = c + w
        bound = bound_ms(
            kind, c=c, f_=f_, b=b, o=o, w=w, pieces=pieces, s0=s0, b0=b0, late=late,
            shares=shares, releases=releases, messages=messages,
        )  # fmt: skip
        measured = 1e3 * statistics.median(times[v])
        after = all(v in r.get("cpu_after", {}) for r in per_rank)
        cpu_after = 1e3 * _cpu_seconds(per_rank, v, "cpu_after") if after else None
        cpu_bound = cpu_bound_ms(
            cpu_ms=1e3 * _cpu_seconds(per_rank, v),
            before_ms=f_,
            cpu_after_ms=cpu_after,
            cores=os.cpu_count() or 1,
        )
        pattern_bound, bound = bound, max(bound, cpu_bound)
        out[v] = {
            "cpu_after_ms": cpu_after,
            "wire_ms": w,
            "late_wire_ms": late,
            "serial_ms": serial,
            "pattern_bound_ms": pattern_bound,
            "cpu_bound_ms": cpu_bound,
            "bound_ms": bound,
            "measured_ms": measured,
            "efficiency": efficiency(serial=serial, bound=bound, measured=measured, compute=c),
        }
    return out
