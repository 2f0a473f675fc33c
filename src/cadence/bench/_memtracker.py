"""``cadence bench fsdp --memtracker``: fully_shard vs FSDP2 at any world and shape, with
torch's MemTracker for the peak.

Model: N x [Linear(d) + GELU] + Linear(d, 1), one unit per block plus the root, no
prefetch, each library's default ``reshard_after_forward``; AdamW (its states count in
the peak). cadence, FSDP2 and a second FSDP2 (A/A) step interleaved in the same ranks
(see [Note: interleaving] in ``_loop.py``); the step time is the slowest rank's.

Peak memory per rank comes from torch's MemTracker (private,
``torch.distributed._tools``) over one tracked step after the timed ones: a tensor-level
count that sees storage resizes, which both implementations use to free unsharded
parameters; ``cadence bench fsdp``'s RSS growth is the process-level figure. One
DataParallel step is tracked too, for the memory sharding saves. Targets as ``cadence
bench fsdp``'s: step time <= 0.70, peak memory <= 1.00.
"""

from __future__ import annotations

import copy
import functools
import statistics
from collections.abc import Callable
from typing import Any

from cadence.bench._loop import interleave, launch_ranks, loadavg, slowest_per_rep
from cadence.bench._record import make_record, paired_ratios, timed_row
from cadence.bench.fsdp import MEMORY_TARGET, TIME_TARGET

__all__ = ["rank_body", "run"]

FULL = {"layers": 8, "width": 512, "batch": 32}
TINY = {"layers": 2, "width": 16, "batch": 4}


def _peak_bytes(model: Any, opt: Any, step: Callable[[], None]) -> int:
    """The peak over one tracked step, as MemTracker counts it (all devices)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")
    return int(sum(snap["Total"] for snap in peak.values()))


def _step(model: Any, opt: Any, x: Any) -> None:
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def rank_body(spec: dict[str, Any], warmup: int, reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from cadence.bench.fsdp import _net, _shard
    from cadence.data_parallel import DataParallel

    base = _net(spec["layers"], spec["width"])
    x = torch.randn(
        spec["batch"], spec["width"], generator=torch.Generator().manual_seed(dist.get_rank())
    )
    runs: dict[str, tuple[Any, Any]] = {}
    for name, impl in (("cadence", "cadence"), ("torch", "torch"), ("torch_b", "torch")):
        model = _shard(impl, copy.deepcopy(base), prefetch=False, reshard=True, device="cpu")
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    steps = {name: functools.partial(_step, *run, x) for name, run in runs.items()}
    times = interleave(steps, warmup=warmup, reps=reps)
    peaks = {name: _peak_bytes(*runs[name], steps[name]) for name in runs}
    dp = DataParallel(copy.deepcopy(base))
    dp_opt = torch.optim.AdamW(dp.parameters(), lr=1e-3)
    _step(dp, dp_opt, x)  # AdamW's states exist from the first step on, as in the others
    peaks["data_parallel"] = _peak_bytes(dp, dp_opt, functools.partial(_step, dp, dp_opt, x))
    return {"times": times, "peaks": peaks}


def run(
    *,
    quick: bool,
    tiny: bool = False,
    world: int = 2,
    layers: int | None = None,
    width: int | None = None,
    batch: int | None = None,
) -> dict[str, Any]:
    """Run the comparison and return its record (not yet written)."""
    from cadence.bench import _memtracker as this

    spec = dict(TINY if tiny else FULL)
    spec |= {k: v for k, v in (("layers", layers), ("width", width), ("batch", batch)) if v}
    warmup, reps = (1, 2) if tiny else (1, 4) if quick else (2, 9)
    load0 = loadavg()
    # MemTracker counts host tensors here: the ranks stay on CPU, over gloo.
    per_rank = launch_ranks(this.rank_body, spec, warmup, reps, world=world, timeout=1800,
                            backend="gloo")  # fmt: skip
    shape = f"{spec['layers']}x{spec['width']}"
    what = f"{spec['layers']} x [Linear({spec['width']}) + GELU] + head, batch {spec['batch']}"
    step = {k: slowest_per_rep([r["times"] for r in per_rank], k) for k in per_rank[0]["times"]}
    peaks = {k: [r["peaks"][k] for r in per_rank] for k in per_rank[0]["peaks"]}  # per rank
    rows = [
        timed_row(shape, step, mine="cadence", ref="torch", ref_b="torch_b",
                  target=TIME_TARGET, what=what),
        timed_row(shape, peaks, mine="cadence", ref="torch", ref_b="torch_b",
                  target=MEMORY_TARGET, metric="peak memory (MemTracker)",
                  abs_name="abs_mib", absolute=lambda v: max(v) / 2**20,
                  extra={"cadence_over_data_parallel": statistics.median(
                      paired_ratios(peaks["cadence"], peaks["data_parallel"]))}),
    ]  # fmt: skip
    return make_record(
        "fsdp-memtracker",
        quick=quick,
        rows=rows,
        load_before=load0,
        settings={"world": world, "backend": "gloo", "warmup": warmup, "reps": reps,
                  "batch_per_rank": spec["batch"], "optimizer": "AdamW",
                  "memory": "torch MemTracker, one step", "threads_per_rank": 1},
    )  # fmt: skip
