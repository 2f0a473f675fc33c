"""Benchmark cadence.pickling against cloudpickle and dill.

Two corpora. Code: nested functions, wrapper chains, a class-heavy payload, a wrapper
from a module with a large unrelated global (pickled with each library's defaults).
Large buffers: a memoryview, a numpy array and a torch CPU tensor of ``--size-mb`` MB,
pickled under protocol 5 with a ``buffer_callback`` (out of band), where zero-copy
matters: ``bytes`` is the in-band payload, ``oob`` the bytes handed to the callback.

Run: ``python bench/bench_pickling.py [--repeat N] [--size-mb M]``. Prints ratios against
cloudpickle (below 1.0 is better for times; sizes are ratios too), not absolute times,
because the machines these run on are shared and absolute numbers do not transfer.
Targets: cadence dumps <= 0.8x cloudpickle's and payload <= 1.0x on the code corpus;
the large buffers stay out of band (oob > 0, bytes tiny) for cadence.
"""

from __future__ import annotations

import argparse
import functools
import pickle
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import cloudpickle
import dill

from cadence import pickling
from cadence.bench.pickler import CORPUS, calls_for

__all__ = ["CORPUS", "main"]


# The code corpus (CORPUS) is `cadence bench pickle`'s, so both measure the same objects.


def big_memoryview(mb: int) -> Any:
    return memoryview(bytearray(mb << 20)).cast("d")


def big_numpy(mb: int) -> Any:
    import numpy as np

    return np.ones(mb << 17, dtype=np.float64)  # 8 bytes each


def big_tensor(mb: int) -> Any:
    import torch

    return torch.ones(mb << 18, dtype=torch.float32)  # 4 bytes each


BUFFERS: dict[str, Callable[[int], Any]] = {
    "memoryview (protocol 5, oob)": big_memoryview,
    "numpy array (protocol 5, oob)": big_numpy,
    "torch tensor (protocol 5, oob)": big_tensor,
}


def _measure(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Best per-call CPU time of each function, the libraries interleaved per round.

    CPU time (process_time) and interleaving both keep the other work on a shared
    machine from favouring whichever library happened to run in a quiet moment.
    """
    sizes = {k: calls_for(f, 0.02) for k, f in fns.items()}  # ~20 ms each
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for k, f in fns.items():
            n = sizes[k]
            t0 = time.process_time()
            for _ in range(n):
                f()
            best[k] = min(best[k], (time.process_time() - t0) / n)
    return best


def _row(name: str, lib: str, t: tuple[float, float, int, int], ref: tuple[float, ...]) -> str:
    d, lo, size, oob = t
    return (f"{name:38} {lib:12} {d / ref[0]:7.2f} {lo / ref[1]:7.2f} "
            f"{size / max(ref[2], 1):7.2f} {size:9d} {oob:11d}")  # fmt: skip


def _run(name: str, obj: Any, libs: dict[str, Any], repeat: int, oob: bool) -> None:
    """Time dumps and loads of ``obj`` for every library; print one row each."""
    kw: dict[str, Any] = {}
    results: dict[str, Any] = {}
    payloads: dict[str, tuple[bytes, list[Any]]] = {}
    for lib, (dumps, _) in libs.items():
        buffers: list[Any] = []
        if oob:
            kw = {"protocol": 5, "buffer_callback": buffers.append}
        try:
            payloads[lib] = (dumps(obj, **kw), buffers)
        except Exception as exc:  # e.g. dill on a memoryview
            results[lib] = f"fails ({type(exc).__name__})"
    ok = [lib for lib in libs if lib in payloads]

    def dump_fn(lib: str) -> Callable[[], Any]:
        dumps = libs[lib][0]
        if not oob:
            return functools.partial(dumps, obj)
        return lambda: dumps(obj, protocol=5, buffer_callback=[].append)

    def load_fn(lib: str) -> Callable[[], Any]:
        data, buffers = payloads[lib]
        return functools.partial(libs[lib][1], data, buffers=buffers) if oob else \
            functools.partial(libs[lib][1], data)  # fmt: skip

    dump_t = _measure({lib: dump_fn(lib) for lib in ok}, repeat)
    load_t = _measure({lib: load_fn(lib) for lib in ok}, repeat)
    for lib in ok:
        data, buffers = payloads[lib]
        oob_bytes = sum(memoryview(b).nbytes for b in buffers)
        results[lib] = (dump_t[lib], load_t[lib], len(data), oob_bytes)
    ref = results["cloudpickle"]
    for lib in libs:
        t = results[lib]
        print(_row(name, lib, t, ref) if isinstance(t, tuple) else f"{name:38} {lib:12} {t}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--size-mb", type=int, default=64, help="size of each large buffer")
    parser.add_argument("--skip-buffers", action="store_true", help="the code corpus only")
    args = parser.parse_args()
    libs = {
        "cadence": (pickling.dumps, pickle.loads),
        "cloudpickle": (cloudpickle.dumps, pickle.loads),
        "dill": (dill.dumps, dill.loads),
    }
    print(f"Python {sys.version.split()[0]}, cloudpickle {cloudpickle.__version__}, "
          f"dill {dill.__version__}; ratios vs cloudpickle (lower is better)")  # fmt: skip
    header = (f"{'workload':38} {'lib':12} {'dumps':>7} {'loads':>7} {'size':>7} "
              f"{'bytes':>9} {'oob':>11}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for name, build in CORPUS.items():
        _run(name, build(), libs, args.repeat, oob=False)
    if args.skip_buffers:
        return
    for name, build in BUFFERS.items():
        try:
            obj = build(args.size_mb)
        except ImportError as exc:
            print(f"{name:38} skipped ({exc})")
            continue
        _run(name, obj, libs, args.repeat, oob=True)


if __name__ == "__main__":
    main()
