"""``cadence bench dp``: cadence.DataParallel against torch DDP, three model shapes.

Per shape every rank holds four copies of one model: a plain one (no wrapper, no
communication: the compute-only step), cadence's DataParallel, torch DDP, and a
second DDP (the A/A noise figure). All four step interleaved (see
[Note: interleaving] in ``_loop.py``); a step is zero_grad + forward + backward
(+ the reduction's end) + SGD step. Both wrappers get the same bucket caps.

Reported per shape: step time cadence / DDP (target <= 0.95), DDP / DDP (A/A),
peak memory growth per rank (each implementation in a fresh process tree; see
[Note: measuring peak memory growth] in ``_memory.py``), and the overlap limit: step time / compute-only step time, for both (1.00 would
mean communication fully hidden; the gap is the exposed communication plus the
wrapper's own CPU work), and the CPU time of all ranks per step (every thread,
gloo's included: on a saturated CPU machine the total work decides the wall time,
and it is far less sensitive to other processes than the wall time).
"""

from __future__ import annotations

import copy
import functools
import statistics
from typing import Any

from cadence.bench._loop import (
    device_and_backend,
    interleave,
    launch_ranks,
    loadavg,
    rank_device,
    slowest_per_rep,
)
from cadence.bench._memory import MEMORY_ENV, floor_page, memory_row, peak_growth
from cadence.bench._record import make_record, timed_row

__all__ = ["CASES", "rank_body", "rss_body", "run"]

TARGET = 0.95

# name -> (model kind, sizes, per-rank batch); "--quick" runs fewer repetitions of
# the same shapes, "tiny" (tests only) shrinks them.
CASES: dict[str, dict[str, Any]] = {
    "mlp": {"what": "12 x [Linear(512) + GELU] + Linear(512, 1), batch 128/rank",
            "model": "mlp", "layers": 12, "width": 512, "batch": 128},
    "transformer": {"what": "4 x TransformerEncoderLayer(256, 4 heads, ff 1024), batch 16 x 32",
                    "model": "transformer", "layers": 4, "width": 256, "batch": 16, "seq": 32},
    "small_params": {"what": "64 x [Linear(64) + LayerNorm(64)] (256 tensors), batch 256/rank",
                     "model": "small", "layers": 64, "width": 64, "batch": 256},
}  # fmt: skip
TINY = {"model": "mlp", "layers": 2, "width": 16, "batch": 4, "what": "tiny plumbing check"}


def _model(spec: dict[str, Any]) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    w = spec["width"]
    if spec["model"] == "mlp":
        mods: list[nn.Module] = []
        for _ in range(spec["layers"]):
            mods += [nn.Linear(w, w), nn.GELU()]
        return nn.Sequential(*mods, nn.Linear(w, 1))
    if spec["model"] == "transformer":
        layer = nn.TransformerEncoderLayer(w, 4, 4 * w, dropout=0.0, batch_first=True)
        return nn.Sequential(*(copy.deepcopy(layer) for _ in range(spec["layers"])))
    mods = []
    for _ in range(spec["layers"]):
        mods += [nn.Linear(w, w), nn.LayerNorm(w)]
    return nn.Sequential(*mods)


def _input(spec: dict[str, Any], rank: int, device: str) -> Any:
    import torch

    g = torch.Generator().manual_seed(rank)
    if spec["model"] == "transformer":
        x = torch.randn(spec["batch"], spec["seq"], spec["width"], generator=g)
    else:
        x = torch.randn(spec["batch"], spec["width"], generator=g)
    return x.to(device)


def rank_body(cases: dict[str, dict[str, Any]], warmup: int, reps: int, cap_mb: float) -> Any:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    device = rank_device()
    out: dict[str, Any] = {}
    for name, spec in cases.items():
        base = _model(spec).to(device)
        models = {"plain": copy.deepcopy(base)}
        for k, impl in (("cadence", "cadence"), ("torch", "torch"), ("torch_b", "torch")):
            models[k] = _wrap(impl, copy.deepcopy(base), cap_mb, device)
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
        x = _input(spec, rank, device)

        def step(
            k: str,
            models: dict[str, Any] = models,
            opts: dict[str, torch.optim.SGD] = opts,
            x: Any = x,
        ) -> None:
            opts[k].zero_grad(set_to_none=True)
            models[k](x).float().pow(2).mean().backward()
            opts[k].step()

        cpu: dict[str, list[float]] = {}
        times = interleave(
            {k: functools.partial(step, k) for k in models}, warmup=warmup, reps=reps, cpu=cpu
        )
        out[name] = {"times": times, "cpu": cpu, "buckets": models["cadence"].num_buckets}
        del models, opts
    return out


def _wrap(impl: str, model: Any, cap_mb: float, device: str) -> Any:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cadence.data_parallel import DataParallel

    if impl == "cadence":
        return DataParallel(model, bucket_cap_mb=cap_mb)
    ddp_kw: dict[str, Any] = {"bucket_cap_mb": cap_mb}
    if device != "cpu":
        ddp_kw["device_ids"] = [torch.cuda.current_device()]
    return DDP(model, **ddp_kw)


def rss_body(impl: str, cases: dict[str, dict[str, Any]], steps: int, cap_mb: float) -> Any:
    """Peak memory growth (bytes) per shape for one implementation, this rank.

    See [Note: measuring peak memory growth] in ``_memory.py``.
    """
    import gc

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    device = rank_device()
    out: dict[str, int] = {}
    for name, spec in cases.items():
        model = _wrap(impl, _model(spec).to(device), cap_mb, device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        x = _input(spec, rank, device)

        def step(model: Any = model, opt: Any = opt, x: Any = x) -> None:
            opt.zero_grad(set_to_none=True)
            model(x).float().pow(2).mean().backward()
            opt.step()

        gc.collect()
        dist.barrier()
        out[name] = peak_growth(step, steps, device)
        dist.barrier()
        del model, opt, step
        gc.collect()
    return out


def summarize(cases: dict[str, dict[str, Any]], per_rank: list[Any]) -> list[dict[str, Any]]:
    rows = []
    for name, spec in cases.items():
        results = [r[name]["times"] for r in per_rank]
        step = {k: slowest_per_rep(results, k) for k in ("plain", "cadence", "torch", "torch_b")}
        med = {k: statistics.median(v) for k, v in step.items()}
        extra = {
            "overlap_limit_cadence": med["cadence"] / med["plain"],
            "overlap_limit_torch": med["torch"] / med["plain"],
            "buckets_cadence": per_rank[0][name]["buckets"],
        }
        rows.append(
            timed_row(name, step, mine="cadence", ref="torch", ref_b="torch_b", target=TARGET,
                      what=spec["what"], extra=extra)
        )  # fmt: skip
        # CPU seconds of all ranks (every thread) per repetition.
        cpu = {
            k: [sum(c) for c in zip(*(r[name]["cpu"][k] for r in per_rank), strict=True)]
            for k in ("plain", "cadence", "torch", "torch_b")
        }
        rows.append(
            timed_row(name, cpu, mine="cadence", ref="torch", ref_b="torch_b", target=None,
                      metric="CPU time, all ranks")
        )  # fmt: skip
    return rows


def run(*, quick: bool, tiny: bool = False, world: int = 2) -> dict[str, Any]:
    """Run the comparison and return its record (not yet written)."""
    cases = {"tiny": TINY} if tiny else CASES
    warmup, reps = (1, 2) if tiny else (3, 12) if quick else (5, 40)
    cap_mb = 1.0
    load0 = loadavg()
    from cadence.bench import dp

    per_rank = launch_ranks(dp.rank_body, cases, warmup, reps, cap_mb, world=world, timeout=1800)
    rows = summarize(cases, per_rank)
    # Memory: a fresh process tree per implementation (the A/A runs DDP twice).
    mem = {
        name: launch_ranks(
            dp.rss_body, impl, cases, 3, cap_mb, world=world, timeout=900, env=MEMORY_ENV
        )
        for name, impl in (("cadence", "cadence"), ("torch", "torch"), ("torch_b", "torch"))
    }
    gpu = device_and_backend(world)[0] == "cuda"
    for name in cases:
        per = {k: [floor_page(r[name]) for r in v] for k, v in mem.items()}  # per rank
        rows.append(memory_row(name, per, "cadence", gpu=gpu, target=None))
    return make_record(
        "dp",
        quick=quick,
        rows=rows,
        load_before=load0,
        settings={"world": world, "backend": device_and_backend(world)[1], "warmup": warmup, "reps": reps, "bucket_cap_mb": cap_mb,
                  "optimizer": "SGD", "threads_per_rank": 1},
    )  # fmt: skip
