"""Benchmark cadence.pickling against cloudpickle and dill on nested-function workloads.

Run: ``python bench/bench_pickling.py [--repeat N]``. Prints ratios against cloudpickle
(below 1.0 is better for times; sizes are ratios too), not absolute times, because the
machines these run on are shared and absolute numbers do not transfer.
"""

from __future__ import annotations

import argparse
import functools
import pickle
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import cloudpickle
import dill

from cadence import pickling

__all__ = ["CORPUS", "main"]


def small_closure() -> Any:
    k = 3

    def add(x):
        return x + k

    return add


def wrapper_chain(depth: int = 8) -> Any:
    def base(x):
        """Base."""
        return x + 1

    fn = base
    for i in range(depth):

        def deco(f, i=i):
            @functools.wraps(f)
            def wrapper(x):
                return f(x) * 2 + i

            return wrapper

        fn = deco(fn)
    return fn


def class_heavy() -> Any:
    ns: dict[str, Any] = {"__name__": "bench_classes"}
    for i in range(30):
        exec(f"def m{i}(self, x):\n    return self.v * x + {i}\n", ns)
    methods = {f"m{i}": ns[f"m{i}"] for i in range(30)}

    def make():
        class Model:
            def __init__(self, v):
                self.v = v
                self.name = f"model-{v}"

        for name, m in methods.items():
            setattr(Model, name, m)
        return Model

    model = make()
    return [model(i) for i in range(200)], model


def large_globals() -> Any:
    # A module holding a large unrelated global; a wraps wrapper published from it.
    mod = types.ModuleType("bench_large_globals")
    sys.modules[mod.__name__] = mod
    exec(
        "import functools\n"
        "SCALE = 3\n"
        "TABLE = list(range(200_000))\n"
        "def scaled(fn):\n"
        "    @functools.wraps(fn)\n"
        "    def wrapper(x):\n"
        "        return fn(x) * SCALE\n"
        "    return wrapper\n"
        "def base(x):\n"
        "    return x + 1\n"
        "h = scaled(base)\n",
        mod.__dict__,
    )
    return mod.h


CORPUS: dict[str, Callable[[], Any]] = {
    "small closure": small_closure,
    "wrapper chain (8)": wrapper_chain,
    "class-heavy (30 methods, 200 inst.)": class_heavy,
    "large module globals": large_globals,
}


def _batch(fn: Callable[[], Any]) -> int:
    # Enough iterations to take ~20 ms, so the timer's resolution does not matter.
    fn()
    n = 1
    while True:
        t0 = time.process_time()
        for _ in range(n):
            fn()
        if time.process_time() - t0 > 0.02:
            return n
        n *= 2


def _measure(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Best per-call CPU time of each function, the libraries interleaved per round.

    CPU time (process_time) and interleaving both keep the other work on a shared
    machine from favouring whichever library happened to run in a quiet moment.
    """
    sizes = {k: _batch(f) for k, f in fns.items()}
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for k, f in fns.items():
            n = sizes[k]
            t0 = time.process_time()
            for _ in range(n):
                f()
            best[k] = min(best[k], (time.process_time() - t0) / n)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    libs = {
        "cadence": (pickling.dumps, pickle.loads),
        "cloudpickle": (cloudpickle.dumps, pickle.loads),
        "dill": (dill.dumps, dill.loads),
    }
    print(f"Python {sys.version.split()[0]}, cloudpickle {cloudpickle.__version__}, "
          f"dill {dill.__version__}; ratios vs cloudpickle (lower is better)")  # fmt: skip
    header = f"{'workload':38} {'lib':12} {'dumps':>7} {'loads':>7} {'size':>7} {'bytes':>9}"
    print(header)
    print("-" * len(header))
    for name, build in CORPUS.items():
        obj = build()
        payloads = {lib: dumps(obj) for lib, (dumps, _) in libs.items()}
        dump_t = _measure({lib: functools.partial(d, obj) for lib, (d, _) in libs.items()},
                          args.repeat)  # fmt: skip
        load_t = _measure(
            {lib: functools.partial(lo, payloads[lib]) for lib, (_, lo) in libs.items()},
            args.repeat,
        )
        results = {lib: (dump_t[lib], load_t[lib], len(payloads[lib])) for lib in libs}
        ref = results["cloudpickle"]
        for lib, (d, lo, size) in results.items():
            print(f"{name:38} {lib:12} {d / ref[0]:7.2f} {lo / ref[1]:7.2f} "
                  f"{size / ref[2]:7.2f} {size:9d}")  # fmt: skip


if __name__ == "__main__":
    main()
