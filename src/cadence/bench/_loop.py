"""The interleaved timing loop the distributed comparisons share, and the launch.

[Note: interleaving]
On a shared machine the load drifts over seconds; two implementations timed one
after the other see different machines. Here every implementation holds its own
copy of the model in the *same* rank processes, and each repetition steps every
variant once, in an order rotated per repetition (so no variant always runs first
or right after the same neighbour). A repetition's ratio compares steps taken
within a few hundred milliseconds of each other; the median over repetitions is
the figure, the quartiles and range its spread. The A/A variant is a second,
identical copy of the torch implementation: its ratio to the first is what
"no difference" looks like under the same noise.

A step's time is the slowest rank's: a barrier precedes each step, and on CUDA
the device is synchronized before the clock stops (collectives and kernels are
asynchronous there, so host time alone would undercount).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "device_and_backend",
    "device_sync",
    "interleave",
    "launch_ranks",
    "loadavg",
    "rank_device",
    "slowest_per_rep",
]


def device_and_backend(world: int) -> tuple[str, str]:
    """("cuda", "nccl") when every rank can have its own GPU, else ("cpu", "gloo")."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        return "cuda", "nccl"
    return "cpu", "gloo"


def rank_device() -> str:
    """This rank's device inside `launch_ranks`: its own GPU, or "cpu"."""
    import torch
    import torch.distributed as dist

    device, _ = device_and_backend(dist.get_world_size())
    return f"cuda:{torch.cuda.current_device()}" if device == "cuda" else "cpu"


def launch_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world: int,
    timeout: float,
    env: Mapping[str, str] | None = None,
    backend: str | None = None,
) -> list[Any]:
    """Run ``fn`` on ``world`` local ranks, one intra-op thread each (both sides alike);
    ``backend`` (default: `device_and_backend`'s) pins it where the question is a CPU's."""
    from cadence.launch import launch

    backend = backend or device_and_backend(world)[1]
    return launch(
        fn,
        *args,
        nprocs=world,
        backend=backend,
        num_threads=1,
        timeout=timeout,
        env={"OMP_NUM_THREADS": "1", **(env or {})},
    )


def device_sync() -> Callable[[], None]:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.synchronize
    return lambda: None


def interleave(
    variants: Mapping[str, Callable[[], None]],
    *,
    warmup: int,
    reps: int,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Per-variant step seconds on this rank, ``reps`` each after ``warmup`` each.

    ``cpu``, if given, receives each step's CPU seconds of this whole process (the
    communication library's threads included). On a saturated machine the total
    CPU work, not the wall time, decides who is faster, and it is far less
    sensitive to what other processes do.
    """
    import torch.distributed as dist

    sync = device_sync()
    names = list(variants)
    out: dict[str, list[float]] = {n: [] for n in names}
    if cpu is not None:
        cpu.update({n: [] for n in names})
    for rep in range(warmup + reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            sync()
            dist.barrier()
            c0 = time.process_time()
            t0 = time.perf_counter()
            variants[name]()
            sync()
            elapsed = time.perf_counter() - t0
            if rep >= warmup:
                out[name].append(elapsed)
                if cpu is not None:
                    cpu[name].append(time.process_time() - c0)
    return out


def slowest_per_rep(per_rank: list[dict[str, list[float]]], name: str) -> list[float]:
    """The slowest rank's time per repetition of one variant."""
    return [max(times) for times in zip(*(r[name] for r in per_rank), strict=True)]


def loadavg() -> list[float]:
    return list(os.getloadavg())
