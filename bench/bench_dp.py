"""cadence.DataParallel against torch DDP, and manual finalization against auto mode.

Run:  OMP_NUM_THREADS=1 .venv/bin/python bench/bench_dp.py [--reps 25] [--layers 12] [--width 512]

One process tree (world 2, gloo, 1 intra-op thread per rank). Every rank holds a
plain copy of the model (no wrapper, no communication: the compute-only
baseline), a cadence.DataParallel copy and a torch DDP copy, and runs them
alternately step by step, rotating the order every repetition, so machine
noise hits all of them alike. A step is zero_grad + forward + backward (+
finalize) + SGD step; its time is the slowest rank's (a barrier precedes each).

Reported, as ratios only (absolute times depend on the machine):
- step time cadence / torch: min, median, max over repetitions;
- exposed communication: (step - compute-only step) / compute-only step for
  both, and for cadence also the time blocked in ``wait()`` from its event log;
- pattern (a): after backward a fixed CPU task (a matmul loop calibrated to the
  length of one blocking all-reduce of all gradients) runs before the
  optimizer. Auto mode waits for the all-reduces and then runs the task; manual
  mode runs the task while they are in flight and finalizes afterwards.

``--profile`` adds a cProfile of 10 cadence and 10 torch steps on rank 0 (top
functions by own time), to see where a difference goes.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))


def make_mlp(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    mods.append(nn.Linear(width, 1))
    return nn.Sequential(*mods)


def _matmul_task(iters: int, a: torch.Tensor, b: torch.Tensor) -> None:
    # The stand-in for sparse work: pure compute on the rank's one thread.
    for _ in range(iters):
        torch.mm(a, b)


def _median_time(fn: Callable[[], None], n: int) -> float:
    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _calibrate_task(numel: int) -> tuple[int, float]:
    """Matmul iterations whose time is about one blocking all-reduce of ``numel`` fp32.

    Every rank must run the same count, so the slowest rank's estimate wins.
    """
    flat = torch.zeros(numel)
    comm_s = _median_time(lambda: dist.all_reduce(flat), 7)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    iter_s = _median_time(lambda: _matmul_task(20, a, b), 5) / 20
    iters = torch.tensor([max(1, round(comm_s / iter_s)), 0], dtype=torch.float64)
    iters[1] = comm_s
    dist.all_reduce(iters, op=dist.ReduceOp.MAX)
    return int(iters[0]), float(iters[1])


def rank_body(
    layers: int,
    width: int,
    batch: int,
    bucket_cap_mb: float,
    warmup: int,
    reps: int,
    profile: bool,
) -> dict[str, Any]:
    import cadence

    rank = dist.get_rank()
    base = make_mlp(layers, width)
    plain = copy.deepcopy(base)
    dp = cadence.DataParallel(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb)
    ddp = DDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb)
    models: dict[str, nn.Module] = {"plain": plain, "cadence": dp, "torch": ddp}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, 1, generator=g)
    numel = sum(p.numel() for p in base.parameters())
    iters, comm_s = _calibrate_task(numel)
    ta, tb = torch.randn(256, 256), torch.randn(256, 256)

    def step(name: str) -> None:
        model, opt = models[name], opts[name]
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    def step_with_task(mode: str) -> None:
        # mode: "auto" (cadence auto: wait, then task), "manual" (task, then finalize),
        # "torch" (DDP: wait, then task).
        model = ddp if mode == "torch" else dp
        opt = opts["torch" if mode == "torch" else "cadence"]
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        _matmul_task(iters, ta, tb)
        if mode == "manual":
            dp.finalize_backward()
        opt.step()

    def timed(fn: Callable[[], None], log: Any) -> tuple[float, float, float]:
        """(step seconds, seconds blocked in cadence's wait(), this process's CPU seconds).

        The CPU time covers every thread of the rank (gloo's included): with the
        wall time it shows whether the cores were saturated, i.e. whether there was
        any idle CPU left for overlap to use.
        """
        log.clear()  # also keeps the log from growing over the run
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        return elapsed, log.wait_time("all_reduce"), time.process_time() - c0

    Times = dict[str, list[tuple[float, float, float]]]

    def phase(names: list[str], run: Callable[[str], None]) -> Times:
        out: Times = {n: [] for n in names}
        for rep in range(warmup + reps):
            # Rotate the order so no variant always runs first (or right after another).
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                if name == "manual":
                    dp.require_manual_backward_finalization = True
                result = timed(lambda n=name: run(n), dp.event_log)
                dp.require_manual_backward_finalization = False
                if rep >= warmup:
                    out[name].append(result)
        return out

    plain_phase = phase(list(models), step)
    task_phase = phase(["auto", "manual", "torch"], step_with_task)
    task_alone = _median_time(lambda: _matmul_task(iters, ta, tb), 5)
    res: dict[str, Any] = {
        "steps": plain_phase,
        "task": task_phase,
        "buckets_cadence": dp.num_buckets,
        "buckets_torch": len(ddp.reducer._get_zeros_like_grad_buckets()),
        "task_iters": iters,
        "task_s": task_alone,
        "comm_s": comm_s,
    }
    if profile and rank == 0:
        res["profile"] = {
            name: _profile(lambda n=name: step(n), 10) for name in ("cadence", "torch")
        }
    elif profile:
        for name in ("cadence", "torch"):  # the peer must run the same collectives
            for _ in range(10):
                step(name)
    return res


def _profile(fn: Callable[[], None], n: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    return buf.getvalue()


def _per_step_max(results: list[dict[str, Any]], key: str, name: str) -> list[float]:
    """The slowest rank's time per measured step."""
    n = len(results[0][key][name])
    return [max(r[key][name][i][0] for r in results) for i in range(n)]


def _mean_wait(results: list[dict[str, Any]], key: str, name: str) -> float:
    return statistics.mean(w for r in results for _, w, _ in r[key][name])


def _cores_busy(results: list[dict[str, Any]], key: str, name: str) -> float:
    """Median over steps of (CPU seconds of both ranks) / (slowest rank's wall seconds)."""
    n = len(results[0][key][name])
    return statistics.median(
        sum(r[key][name][i][2] for r in results) / max(r[key][name][i][0] for r in results)
        for i in range(n)
    )


def _ratios(a: list[float], b: list[float]) -> str:
    rs = sorted(x / y for x, y in zip(a, b))
    return f"{rs[0]:.2f} / {statistics.median(rs):.2f} / {rs[-1]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128, help="per rank")
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    import bench_dp  # by reference, so the ranks import it instead of unpickling __main__
    from cadence import launch

    load_before = os.getloadavg()[0]
    results = launch(
        bench_dp.rank_body,
        args.layers,
        args.width,
        args.batch,
        args.bucket_cap_mb,
        args.warmup,
        args.reps,
        args.profile,
        nprocs=2,
        backend="gloo",
        num_threads=1,
        timeout=600,
        env={"OMP_NUM_THREADS": "1"},
    )
    load_after = os.getloadavg()[0]
    r0 = results[0]
    names = list(r0["steps"])
    step = {n: _per_step_max(results, "steps", n) for n in names}
    compute = statistics.median(step["plain"])
    print(
        f"model: {args.layers} x Linear({args.width},{args.width}) + ReLU, head Linear("
        f"{args.width},1); SGD; batch {args.batch}/rank; world 2, gloo, 1 thread/rank; "
        f"bucket_cap_mb={args.bucket_cap_mb}; buckets: cadence {r0['buckets_cadence']}, "
        f"torch {r0['buckets_torch']}; {args.reps} measured steps per variant after "
        f"{args.warmup} warm-up, alternating; {os.cpu_count()} CPUs, 1-min load average "
        f"{load_before:.1f} before / {load_after:.1f} after"
    )
    print()
    label = {"plain": "compute only", "cadence": "cadence", "torch": "torch DDP"}
    print(
        "| variant | step / compute-only (median) | exposed comm / compute | "
        "blocked in wait() / compute | cores busy |"
    )
    print("|---|---|---|---|---|")
    for n in names:
        med = statistics.median(step[n])
        wait = (
            "n/a" if n in ("plain", "torch") else f"{_mean_wait(results, 'steps', n) / compute:.2f}"
        )
        exposed = "-" if n == "plain" else f"{(med - compute) / compute:.2f}"
        print(
            f"| {label[n]} | {med / compute:.2f} | {exposed} | {wait} | "
            f"{_cores_busy(results, 'steps', n):.2f} |"
        )
    print()
    print(
        f"step-time ratio cadence / torch, min / median / max: {_ratios(step['cadence'], step['torch'])}"
    )
    print()
    task = {n: _per_step_max(results, "task", n) for n in ("auto", "manual", "torch")}
    auto = statistics.median(task["auto"])
    print(
        f"pattern (a): after backward a fixed {r0['task_iters']}-matmul task; task / one "
        f"blocking all-reduce of all grads = {r0['task_s'] / r0['comm_s']:.2f}"
    )
    print("| variant | step / auto (median) | blocked in wait() / compute | cores busy |")
    print("|---|---|---|---|")
    rows = {
        "auto": "cadence auto (wait, then task)",
        "manual": "cadence manual (task, then finalize)",
        "torch": "torch DDP (wait, then task)",
    }
    for n, text in rows.items():
        wait = "n/a" if n == "torch" else f"{_mean_wait(results, 'task', n) / compute:.2f}"
        print(
            f"| {text} | {statistics.median(task[n]) / auto:.2f} | {wait} | "
            f"{_cores_busy(results, 'task', n):.2f} |"
        )
    print()
    print(
        f"step-time ratio manual / auto, min / median / max: {_ratios(task['manual'], task['auto'])}"
    )
    print(
        "step-time ratio manual / torch DDP, min / median / max: "
        f"{_ratios(task['manual'], task['torch'])}"
    )
    if "profile" in r0:
        for name, text in r0["profile"].items():
            print(f"\n--- cProfile, rank 0, 10 {name} steps (by own time) ---")
            print(text)


if __name__ == "__main__":
    main()
