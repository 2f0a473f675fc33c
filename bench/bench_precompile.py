"""Time to the first training step on N ranks: every rank compiling vs precompile.

Run: ``python bench/bench_precompile.py [--ranks 2] [--width 256] [--depth 3] [--repeat 3]``.

Three ways to reach the first step, each in fresh rank processes (``cadence.launch``)
with a fresh inductor cache per rank (a cold node each, unless ``--shared-inductor-cache``):

* ``jit``: every rank runs ``torch.compile(step, fullgraph=True)`` and takes its first
  step (what a job does without precompile);
* ``precompile``: rank 0 compiles ahead of time, broadcasts the artifact (with its C++
  kernels unless ``--no-ship-kernels``), every other rank loads it;
* ``cache``: every rank loads the artifact that the ``precompile`` run wrote to
  ``cache_dir``.

Per mode it prints the wall time to the first step (the slowest rank: the job waits for
it) and the CPU time summed over ranks, including the C++ compiler's child processes:
on a shared host the ranks compete for the same cores, so CPU is what precompile saves.
On CPU the gain is one compile per job instead of one per rank, not a faster kernel.
Numbers from a shared machine mean little; take them on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import cadence

__all__ = ["main"]


def _cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _rank(mode: str, width: int, depth: int, base: str, shared: bool, ship: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank = dist.get_rank()
    if not shared:  # before inductor reads it: each rank is a cold node
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"inductor-{mode}-{rank}")
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    x, y = torch.randn(32, width), torch.randint(0, 10, (32,))

    def step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    dist.barrier()
    start, cpu = time.perf_counter(), _cpu()
    if mode == "jit":
        fn: Any = torch.compile(step, fullgraph=True)
        source = "jit"
    else:
        fn = cadence.precompile(
            step, (model, x, y), cache_dir=os.path.join(base, "cache"), ship_kernels=ship
        )
        source = fn.source
    fn(model, x, y).backward()
    return {"wall": time.perf_counter() - start, "cpu": _cpu() - cpu, "source": source}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shared-inductor-cache", action="store_true")
    parser.add_argument("--no-ship-kernels", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args()

    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}
    runs: dict[str, list[list[dict[str, Any]]]] = {"jit": [], "precompile": [], "cache": []}
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="bench-precompile-") as base:
            for mode in runs:
                runs[mode].append(
                    cadence.launch(
                        _rank,
                        mode,
                        args.width,
                        args.depth,
                        base,
                        args.shared_inductor_cache,
                        not args.no_ship_kernels,
                        nprocs=args.ranks,
                        env=env,
                        num_threads=1,
                        timeout=1800,
                    )
                )
    print(
        f"{args.ranks} ranks, MLP width {args.width} depth {args.depth}, "
        f"median of {args.repeat} (fresh processes, "
        f"{'shared' if args.shared_inductor_cache else 'per-rank cold'} inductor cache)"
    )
    print(f"{'mode':<12}{'first step, slowest rank (s)':>30}{'CPU, all ranks (s)':>22}  sources")
    for mode, reps in runs.items():
        wall = statistics.median(max(r["wall"] for r in rep) for rep in reps)
        cpu = statistics.median(sum(r["cpu"] for r in rep) for rep in reps)
        sources = sorted({r["source"] for rep in reps for r in rep})
        print(f"{mode:<12}{wall:>30.2f}{cpu:>22.2f}  {', '.join(sources)}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
