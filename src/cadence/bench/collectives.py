"""``cadence bench collectives``: cadence's exchange collectives against gloo's own.

One collective per step, issued and waited, through `cadence.Comm` with
``CollectiveAlgorithms`` set to exchange, and to native twice (the A/A), in the same
ranks, interleaved (see [Note: interleaving] in ``_loop.py``). Reduce-scatter and
all-gather are what fully_shard issues (``"auto"`` picks exchange for them); the
all-reduce row shows why DataParallel keeps gloo's own by default (see
[Note: why cadence replaces some of gloo's collectives] in ``cadence/_groups/exchange.py``).
Sizes are the full (unsharded) tensor. There is no target: this is the evidence for
a default, not a goal. `crossovers` reads a record into the table ``"auto"`` chooses
by (``AUTO_CROSSOVER_BYTES``, see [Note: auto picks by measured crossovers] in
``cadence/_groups/exchange.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cadence.bench._loop import (
    device_and_backend,
    interleave,
    launch_ranks,
    loadavg,
    slowest_per_rep,
)
from cadence.bench._record import make_record, timed_row

__all__ = ["CROSSOVER_RATIO", "crossovers", "rank_body", "run"]

KINDS = ("reduce_scatter", "all_gather", "all_reduce")
VARIANTS = ("exchange", "native", "native_b")
SIZES_MIB = [0.0625, 0.25, 1.0, 4.0, 16.0]
# The exchange counts as faster from a size whose median ratio is below this: a margin
# for the A/A noise (medians of gloo against itself land within about 0.9-1.1 here).
CROSSOVER_RATIO = 0.95


def crossovers(record: dict[str, Any]) -> dict[str, dict[int, int | None]]:
    """Per collective and world: the smallest measured size (bytes) from which the
    exchange's median ratio stays under `CROSSOVER_RATIO` at every larger measured
    size; None where the largest size is not under it."""
    by_case: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for row in record["rows"]:
        extra = row["extra"]
        by_case.setdefault((extra["kind"], extra["world"]), []).append(
            (extra["bytes"], row["ratio"]["median"])
        )
    table: dict[str, dict[int, int | None]] = {}
    for (kind, world), points in sorted(by_case.items()):
        threshold: int | None = None
        for nbytes, ratio in sorted(points, reverse=True):
            if ratio >= CROSSOVER_RATIO:
                break
            threshold = nbytes
        table.setdefault(kind, {})[world] = threshold
    return table


def _step(kind: str, comm: Any, full: Any, shard: Any) -> Callable[[], Any]:
    """One blocking collective of ``kind`` on preallocated buffers."""
    import torch

    if kind == "reduce_scatter":
        out = torch.empty_like(shard)
        return lambda: comm.reduce_scatter_single(out, full)
    if kind == "all_gather":
        gathered = torch.empty_like(full)
        return lambda: comm.all_gather_single(gathered, shard)
    buf = full.clone()
    return lambda: comm.all_reduce(buf)


def _elements(mib: float, world: int) -> int:
    return max(world, int(mib * 262144) // world * world)  # float32, divisible by world


def rank_body(sizes_mib: list[float], warmup: int, reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from cadence.comm import CollectiveAlgorithms, Comm

    world, rank = dist.get_world_size(), dist.get_rank()
    comms = {
        "exchange": Comm(algorithms=CollectiveAlgorithms("exchange", "exchange", "exchange")),
        "native": Comm(algorithms=CollectiveAlgorithms.native()),
        "native_b": Comm(algorithms=CollectiveAlgorithms.native()),
    }
    out: dict[str, Any] = {}
    for mib in sizes_mib:
        n = _elements(mib, world)
        full = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        shard = full[: n // world].clone()
        for kind in KINDS:
            steps = {name: _step(kind, comms[name], full, shard) for name in VARIANTS}
            out[f"{kind}|{mib}"] = interleave(steps, warmup=warmup, reps=reps)
    return out


def run(
    *, quick: bool, tiny: bool = False, worlds: tuple[int, ...] | None = None
) -> dict[str, Any]:
    """Run the comparison and return its record (not yet written)."""
    from cadence.bench import collectives

    sizes = [0.01] if tiny else [1.0, 4.0] if quick else SIZES_MIB
    worlds = worlds or ((2,) if tiny or quick else (2, 4, 8))
    warmup, reps = (1, 2) if tiny else (3, 10) if quick else (5, 30)
    load0 = loadavg()
    rows: list[dict[str, Any]] = []
    for world in worlds:
        per_rank = launch_ranks(
            collectives.rank_body, sizes, warmup, reps, world=world, timeout=900
        )
        for key in per_rank[0]:
            kind, mib = key.split("|")
            results = [r[key] for r in per_rank]
            t = {name: slowest_per_rep(results, name) for name in VARIANTS}
            case = f"{kind} {float(mib):g} MiB, world {world}"
            extra = {"kind": kind, "world": world, "bytes": 4 * _elements(float(mib), world)}
            rows.append(
                timed_row(case, t, mine="exchange", ref="native", ref_b="native_b",
                          target=None, metric="time", extra=extra)
            )  # fmt: skip
    return make_record(
        "collectives",
        quick=quick,
        rows=rows,
        load_before=load0,
        settings={"worlds": list(worlds), "backend": device_and_backend(worlds[0])[1],
                  "warmup": warmup, "reps": reps, "threads_per_rank": 1},
    )  # fmt: skip
