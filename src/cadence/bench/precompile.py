"""``cadence bench precompile``: time to the first training step, JIT against precompile.

Three ways for ``world`` ranks to reach their first step (forward + backward of an
MLP's cross-entropy loss):

* ``jit``: every rank runs ``torch.compile(step, fullgraph=True)`` and takes its
  first step (what a job does without precompile);
* ``precompile``: ``cadence.precompile`` with an empty ``cache_dir``: rank 0
  compiles ahead of time and broadcasts the artifact (with its C++ kernels), every
  other rank loads it;
* ``cache``: every rank loads the artifact from a ``cache_dir`` a previous job
  wrote (a restarted job).

[Note: cold nodes, fresh processes]
Compilation state lives in two places: the process (dynamo's code cache) and the
node (inductor's on-disk cache, C++ kernels included). A warm one of either would
measure a cache hit, not a compile. So every run of every mode is a fresh launch of
``world`` rank processes, and each rank points ``TORCHINDUCTOR_CACHE_DIR`` at an
empty directory of its own before inductor first reads it: each rank is a cold
node (with ``shared_inductor_cache`` the ranks of one run share one empty
directory: one cold node). Per repetition the modes run in an order rotated by one
(see [Note: interleaving] in ``_loop.py``); ``jit_b``, a second ``jit`` run, is
the A/A noise figure. The ``cache`` mode loads what the latest ``precompile`` run
wrote: ``MODES`` puts ``precompile`` before ``cache``, so in the first repetition,
and hence in every one, there is such a run.

The time of a mode is the slowest rank's, from a barrier to the end of its first
backward (the job waits for its slowest rank). Every mode imports dynamo (with
``cadence.precompile``) before the clock starts; what else a mode imports on its
way (inductor, the loader) counts as its own. Its CPU time is summed over ranks
and includes the C++ compiler's child processes (``TORCHINDUCTOR_COMPILE_THREADS=1``
keeps inductor from farming the compile out to a worker pool this clock would
miss): on a shared host the ranks compete for the same cores, so the CPU a job
spends compiling is what precompile saves. On CPU the gain is one compile per job
instead of one per rank, not a faster kernel: every mode runs the same kernels.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from collections.abc import Callable
from typing import Any

from cadence.bench._loop import device_and_backend, launch_ranks, loadavg, rank_device
from cadence.bench._record import make_record, timed_row
from cadence.errors import CadenceRuntimeError

__all__ = ["MODES", "rank_body", "run"]

MODES = ("jit", "jit_b", "precompile", "cache")
FULL = {"width": 256, "depth": 3, "batch": 32, "backend": "inductor"}
QUICK = {"width": 64, "depth": 2, "batch": 32, "backend": "inductor"}
# A plumbing check (tests): the "eager" backend traces, serializes, broadcasts and
# caches through the same code as inductor but compiles nothing, so a mode's timed
# part takes about a second and the launches dominate.
TINY = {"width": 8, "depth": 1, "batch": 4, "backend": "eager"}
ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


def _cpu_seconds() -> float:
    """This process's CPU time plus that of its finished children (the C++ compiler)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def rank_body(
    mode: str,
    spec: dict[str, Any],
    node_dir: str,
    cache_dir: str,
    shared_inductor_cache: bool,
    ship_kernels: bool,
) -> dict[str, Any]:
    """One rank's way to its first step in one mode: seconds, CPU seconds, source."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from cadence.precompiling import precompile

    rank = dist.get_rank()
    node = "shared" if shared_inductor_cache else f"rank{rank}"
    # Before inductor first reads it: see [Note: cold nodes, fresh processes].
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(node_dir, f"inductor-{node}")
    device = rank_device()
    torch.manual_seed(0)
    w = spec["width"]
    layers = [m for _ in range(spec["depth"]) for m in (torch.nn.Linear(w, w), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(w, 10)).to(device)
    x = torch.randn(spec["batch"], w, device=device)
    y = torch.randint(0, 10, (spec["batch"],), device=device)

    def step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    sync: Callable[[], None] = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    dist.barrier()
    start, cpu = time.perf_counter(), _cpu_seconds()
    if mode.startswith("jit"):
        fn: Any = torch.compile(step, fullgraph=True, backend=spec["backend"])
        source = "jit"
    else:
        fn = precompile(
            step, (model, x, y), cache_dir=cache_dir, backend=spec["backend"],
            ship_kernels=ship_kernels,
        )  # fmt: skip
        source = fn.source
    fn(model, x, y).backward()
    sync()
    return {"wall": time.perf_counter() - start, "cpu": _cpu_seconds() - cpu, "source": source}


def _expected_sources(mode: str, world: int) -> set[str]:
    if mode.startswith("jit"):
        return {"jit"}
    if mode == "cache":
        return {"cache"}
    return {"compiled", "received"} if world > 1 else {"compiled"}


def _launch(mode: str, spec: dict[str, Any], node_dir: str, cache_dir: str, world: int,
            shared: bool, ship: bool) -> list[dict[str, Any]]:  # fmt: skip
    from cadence.bench import precompile as this

    per_rank = launch_ranks(
        this.rank_body, mode, spec, node_dir, cache_dir, shared, ship,
        world=world, timeout=1800, env=ENV,
    )  # fmt: skip
    sources = {r["source"] for r in per_rank}
    if sources != _expected_sources(mode, world):
        # A cache run that compiled (or a precompile run that hit a cache) would
        # time the wrong thing: refuse the figure rather than print it.
        raise CadenceRuntimeError(
            f"cadence bench precompile: the {mode!r} run reached its step via "
            f"{sorted(sources)}, expected {sorted(_expected_sources(mode, world))}; "
            "its time would not measure that mode. Check that nothing else writes "
            f"{cache_dir} and that every rank runs the same torch and environment"
        )
    return per_rank


def run(
    *,
    quick: bool,
    tiny: bool = False,
    world: int = 2,
    shared_inductor_cache: bool = False,
    ship_kernels: bool = True,
) -> dict[str, Any]:
    """Run the comparison and return its record (not yet written)."""
    spec = TINY if tiny else QUICK if quick else FULL
    reps = 1 if tiny else 2 if quick else 5
    load0 = loadavg()
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    sources: dict[str, set[str]] = {m: set() for m in MODES}
    args = (world, shared_inductor_cache, ship_kernels)
    with tempfile.TemporaryDirectory(prefix="cadence-bench-precompile-") as base:
        written = ""  # the cache_dir of the latest precompile run
        for rep in range(reps):
            k = rep % len(MODES)
            for mode in MODES[k:] + MODES[:k]:
                node_dir = os.path.join(base, f"rep{rep}-{mode}")
                cache_dir = written if mode == "cache" else os.path.join(node_dir, "cache")
                per_rank = _launch(mode, spec, node_dir, cache_dir, *args)
                if mode == "precompile":
                    written = cache_dir
                wall[mode].append(max(r["wall"] for r in per_rank))
                cpu[mode].append(sum(r["cpu"] for r in per_rank))
                sources[mode].update(r["source"] for r in per_rank)
    rows = []
    for metric, times in (("time to first step, slowest rank", wall),
                          ("CPU time to first step, all ranks", cpu)):  # fmt: skip
        for mode in ("precompile", "cache"):
            rows.append(
                timed_row(mode, times, mine=mode, ref="jit", ref_b="jit_b", target=None,
                          metric=metric, what=f"{mode} / jit on {world} ranks",
                          extra={"sources": ",".join(sorted(sources[mode]))})
            )  # fmt: skip
    # Another rank count or cache layout is a variant, never the page's figure: see
    # [Note: a further question writes a record of its own kind] in ``_run.py``.
    default = (world, shared_inductor_cache, ship_kernels) == (2, False, True)
    return make_record(
        "precompile" if default else "precompile-variant",
        quick=quick,
        rows=rows,
        load_before=load0,
        settings={"world": world, "backend": device_and_backend(world)[1],
                  "compile_backend": spec["backend"], "reps": reps,
                  "model": f"MLP width {spec['width']} depth {spec['depth']} + Linear(10), "
                           f"batch {spec['batch']}",
                  "inductor_cache": "one cold per run" if shared_inductor_cache
                                    else "one cold per rank",
                  "ship_kernels": ship_kernels, "threads_per_rank": 1},
    )  # fmt: skip
