"""``cadence bench dp --finalize-patterns``: DataParallel's manual finalization vs auto.

One process tree. Every rank holds a plain copy of an MLP (no wrapper, no
communication: the compute-only step), cadence's DataParallel, torch DDP and a second
DDP (A/A), and steps them interleaved (see [Note: interleaving] in ``_loop.py``); a
step is zero_grad + forward + backward (+ finalize) + SGD step.

Pattern (a): after backward a fixed CPU task (a matmul loop calibrated to the length
of one blocking all-reduce of all gradients) runs before the optimizer. Auto mode
waits for the all-reduces, then runs the task; manual mode
(``require_manual_backward_finalization``) runs the task while they are in flight and
calls ``finalize_backward()`` after it; DDP waits, then runs the task.

Rows: step time cadence / DDP without the task; manual / auto and manual / DDP with
it (A/A: DDP / DDP in the same phase). Extras, over the compute-only step: the
exposed communication ((step - compute) / compute), the time blocked in cadence's
``wait()`` (from its event log), and cores busy (CPU seconds of all ranks, every
thread, over the slowest rank's wall time: whether an idle core was left for the
overlap to use). ``profile`` adds a cProfile of 10 cadence and 10 DDP steps on rank 0
(top functions by own time) to the record, to see where a difference goes.
"""

from __future__ import annotations

import copy
import cProfile
import functools
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

from cadence.bench._loop import interleave, launch_ranks, loadavg, slowest_per_rep
from cadence.bench._record import make_record, timed_row

__all__ = ["rank_body", "run"]

CAP_MB = 1.0
FULL = {"layers": 12, "width": 512, "batch": 128}
TINY = {"layers": 2, "width": 16, "batch": 4}
PROFILED_STEPS = 10


def _matmul_task(iters: int, a: Any, b: Any) -> None:
    # The stand-in for sparse work: pure compute on the rank's one thread.
    import torch

    for _ in range(iters):
        torch.mm(a, b)


def _median_time(fn: Callable[[], None], n: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _calibrate_task(numel: int, a: Any, b: Any) -> tuple[int, float]:
    """Matmul iterations whose time is about one blocking all-reduce of ``numel`` fp32,
    and that all-reduce's seconds. Every rank must run the same count, so the slowest
    rank's estimate wins."""
    import torch
    import torch.distributed as dist

    flat = torch.zeros(numel)
    comm_s = _median_time(functools.partial(dist.all_reduce, flat), 7)  # type: ignore[arg-type]
    iter_s = _median_time(lambda: _matmul_task(20, a, b), 5) / 20
    agreed = torch.tensor([max(1, round(comm_s / iter_s)), comm_s], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return int(agreed[0]), float(agreed[1])


def _profile(fn: Callable[[], None], n: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    return buf.getvalue()


def rank_body(spec: dict[str, Any], warmup: int, reps: int, profile: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from cadence.bench.dp import _input, _model, _wrap

    rank = dist.get_rank()
    base = _model({"model": "mlp", **spec})
    dp = _wrap("cadence", copy.deepcopy(base), CAP_MB, "cpu")
    models = {"plain": copy.deepcopy(base), "cadence": dp}
    models |= {k: _wrap("torch", copy.deepcopy(base), CAP_MB, "cpu") for k in ("torch", "torch_b")}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
    x = _input({"model": "mlp", **spec}, rank, "cpu")
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    iters, comm_s = _calibrate_task(sum(p.numel() for p in base.parameters()), a, b)

    def step(name: str) -> None:
        opts[name].zero_grad(set_to_none=True)
        models[name](x).pow(2).mean().backward()
        opts[name].step()

    def step_with_task(mode: str) -> None:
        # auto: the wrapper waits in backward, then the task; manual: the task runs
        # while the all-reduces are in flight, then finalize; torch*: DDP waits.
        name = mode if mode.startswith("torch") else "cadence"
        opts[name].zero_grad(set_to_none=True)
        dp.require_manual_backward_finalization = mode == "manual"
        try:
            models[name](x).pow(2).mean().backward()
            _matmul_task(iters, a, b)
            if mode == "manual":
                dp.finalize_backward()
        finally:
            dp.require_manual_backward_finalization = False
        opts[name].step()

    def phase(names: list[str], run: Callable[[str], None]) -> dict[str, Any]:
        waits: dict[str, list[float]] = {n: [] for n in names}

        def variant(name: str) -> Callable[[], None]:
            def go() -> None:
                dp.event_log.clear()  # only this step's waits; also bounds the log
                run(name)
                waits[name].append(dp.event_log.wait_time("all_reduce"))

            return go

        cpu: dict[str, list[float]] = {}
        times = interleave({n: variant(n) for n in names}, warmup=warmup, reps=reps, cpu=cpu)
        # interleave keeps the measured steps only: drop the warm-up steps' waits too.
        return {"times": times, "cpu": cpu, "wait": {n: w[warmup:] for n, w in waits.items()}}

    out: dict[str, Any] = {
        "steps": phase(list(models), step),
        "task": phase(["auto", "manual", "torch", "torch_b"], step_with_task),
        "buckets": dp.num_buckets,
        "task_iters": iters,
        "task_s": _median_time(lambda: _matmul_task(iters, a, b), 5),
        "comm_s": comm_s,
    }
    if profile:
        # Every rank runs the same steps (the peer must join the collectives); rank 0's
        # are profiled.
        for name in ("cadence", "torch"):
            go = functools.partial(step, name)
            if rank == 0:
                out.setdefault("profile", {})[name] = _profile(go, PROFILED_STEPS)
            else:
                for _ in range(PROFILED_STEPS):
                    go()
    return out


def _cores_busy(per_rank: list[dict[str, Any]], name: str) -> float:
    """Median over repetitions of (CPU seconds of all ranks) / (slowest rank's wall)."""
    wall = slowest_per_rep([r["times"] for r in per_rank], name)
    cpu: list[float] = [sum(c) for c in zip(*(r["cpu"][name] for r in per_rank), strict=True)]
    return statistics.median(c / w for c, w in zip(cpu, wall, strict=True))


def _blocked(per_rank: list[dict[str, Any]], name: str, compute: float) -> float:
    """Mean seconds blocked in cadence's wait() per step, over the compute-only step."""
    waits: list[float] = [w for r in per_rank for w in r["wait"][name]]
    return statistics.mean(waits) / compute


def _rows(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    steps = [r["steps"] for r in per_rank]
    times = {k: slowest_per_rep([s["times"] for s in steps], k) for k in steps[0]["times"]}
    compute = statistics.median(times["plain"])
    exposed = {k: (statistics.median(times[k]) - compute) / compute for k in ("cadence", "torch")}
    extra = {
        "exposed_comm_cadence": exposed["cadence"],
        "exposed_comm_torch": exposed["torch"],
        "blocked_in_wait_cadence": _blocked(steps, "cadence", compute),
        **{f"cores_busy_{k}": _cores_busy(steps, k) for k in ("plain", "cadence", "torch")},
        "buckets_cadence": per_rank[0]["buckets"],
    }
    rows = [
        timed_row("no task", times, mine="cadence", ref="torch", ref_b="torch_b", target=None,
                  what="cadence auto / DDP", extra=extra)
    ]  # fmt: skip
    tasks = [r["task"] for r in per_rank]
    task = {k: slowest_per_rep([t["times"] for t in tasks], k) for k in tasks[0]["times"]}
    r0 = per_rank[0]
    extra = {
        "task_over_allreduce": r0["task_s"] / r0["comm_s"],
        "task_matmuls": r0["task_iters"],
        "blocked_in_wait_auto": _blocked(tasks, "auto", compute),
        "blocked_in_wait_manual": _blocked(tasks, "manual", compute),
        **{f"cores_busy_{k}": _cores_busy(tasks, k) for k in ("auto", "manual", "torch")},
    }
    for ref, what in (("auto", "manual (task, then finalize) / auto (wait, then task)"),
                      ("torch", "manual (task, then finalize) / DDP (wait, then task)")):  # fmt: skip
        rows.append(
            timed_row(f"pattern (a) vs {ref}", task, mine="manual", ref=ref, ref_b="torch_b",
                      aa_of="torch", target=None, what=what, extra=extra)
        )  # fmt: skip
    return rows


def run(
    *,
    quick: bool,
    tiny: bool = False,
    world: int = 2,
    layers: int | None = None,
    width: int | None = None,
    batch: int | None = None,
    profile: bool = False,
) -> dict[str, Any]:
    """Run the comparison and return its record (not yet written)."""
    from cadence.bench import _finalize_patterns as this

    spec = dict(TINY if tiny else FULL)
    spec |= {k: v for k, v in (("layers", layers), ("width", width), ("batch", batch)) if v}
    warmup, reps = (1, 2) if tiny else (2, 12) if quick else (3, 40)
    load0 = loadavg()
    # On CPU only: the question is whether a compute core is left for gloo's threads.
    per_rank = launch_ranks(
        this.rank_body, spec, warmup, reps, profile, world=world, timeout=1800, backend="gloo"
    )
    record = make_record(
        "dp-finalize-patterns",
        quick=quick,
        rows=_rows(per_rank),
        load_before=load0,
        settings={"world": world, "backend": "gloo", "warmup": warmup, "reps": reps,
                  "model": f"{spec['layers']} x [Linear({spec['width']}) + GELU] + "
                           f"Linear({spec['width']}, 1)",
                  "batch_per_rank": spec["batch"], "bucket_cap_mb": CAP_MB,
                  "optimizer": "SGD", "threads_per_rank": 1},
    )  # fmt: skip
    record["what"] = "cadence / DDP without the task; with it, manual / auto and manual / DDP"
    if profile:
        record["profiles"] = {
            f"cProfile, rank 0, {PROFILED_STEPS} {k} steps (by own time)": text
            for k, text in per_rank[0]["profile"].items()
        }
    return record
