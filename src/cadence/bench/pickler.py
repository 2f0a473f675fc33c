"""``cadence bench pickle``: cadence.pickling.dumps against cloudpickle.dumps.

One process. Corpus: a small closure, a chain of eight ``functools.wraps``
wrappers, a class with 30 methods and 200 instances, and a wrapper whose module
holds a large unrelated global. Per repetition each of cadence, cloudpickle and a
second cloudpickle (A/A) pickles the object a fixed number of times (enough for
~20 ms), the order rotated per repetition; time is CPU time of this process.
Targets: dumps time <= 0.80 of cloudpickle's; payload size <= 1.00.
(``--loads``, ``--dill``, ``--out-of-band``: `cadence.bench._pickle_extended`.)
"""

from __future__ import annotations

import functools
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from cadence.bench._loop import loadavg
from cadence.bench._record import make_record, ratio_summary, timed_row

__all__ = ["CORPUS", "calls_for", "run"]

TIME_TARGET = 0.80
SIZE_TARGET = 1.00


def _small_closure() -> Any:
    k = 3

    def add(x: int) -> int:
        return x + k

    return add


def _wrapper_chain(depth: int = 8) -> Any:
    def base(x: int) -> int:
        """Base."""
        return x + 1

    fn: Callable[[int], int] = base
    for i in range(depth):

        def deco(f: Callable[[int], int], i: int = i) -> Callable[[int], int]:
            @functools.wraps(f)
            def wrapper(x: int) -> int:
                return f(x) * 2 + i

            return wrapper

        fn = deco(fn)
    return fn


def _class_heavy() -> Any:
    ns: dict[str, Any] = {"__name__": "bench_classes"}
    for i in range(30):
        exec(f"def m{i}(self, x):\n    return self.v * x + {i}\n", ns)

    class Model:
        def __init__(self, v: int) -> None:
            self.v = v
            self.name = f"model-{v}"

    for i in range(30):
        setattr(Model, f"m{i}", ns[f"m{i}"])
    return [Model(i) for i in range(200)], Model


def _large_globals() -> Any:
    mod = types.ModuleType("cadence_bench_large_globals")
    sys.modules[mod.__name__] = mod  # importable by name would pickle by reference: it is not
    exec(
        "import functools\nSCALE = 3\nTABLE = list(range(200_000))\n"
        "def scaled(fn):\n    @functools.wraps(fn)\n    def wrapper(x):\n"
        "        return fn(x) * SCALE\n    return wrapper\n"
        "def base(x):\n    return x + 1\nh = scaled(base)\n",
        mod.__dict__,
    )
    del sys.modules[mod.__name__]
    return mod.h


CORPUS: dict[str, Callable[[], Any]] = {
    "small closure": _small_closure,
    "wrapper chain (8)": _wrapper_chain,
    "class-heavy (30 methods, 200 instances)": _class_heavy,
    "large module globals": _large_globals,
}


def calls_for(fn: Callable[[], Any], seconds: float) -> int:
    """Calls of ``fn`` (doubling) that take over ``seconds`` of CPU: timer resolution stops mattering."""
    fn()
    n = 1
    while True:
        t0 = time.process_time()
        for _ in range(n):
            fn()
        if time.process_time() - t0 > seconds:
            return n
        n *= 2


def run(*, quick: bool, tiny: bool = False) -> dict[str, Any]:
    """Run the comparison and return its record (not yet written)."""
    try:
        import cloudpickle
    except ImportError as exc:
        raise ImportError(
            "cadence bench pickle compares against cloudpickle: pip install cloudpickle"
        ) from exc
    from cadence import pickling

    libs = {"cadence": pickling.dumps, "cloudpickle": cloudpickle.dumps,
            "cloudpickle_b": cloudpickle.dumps}  # fmt: skip
    reps = 3 if tiny else 15 if quick else 41
    budget = 0.001 if tiny else 0.02
    load0 = loadavg()
    rows = []
    corpus = dict(list(CORPUS.items())[:1]) if tiny else CORPUS
    for case, build in corpus.items():
        obj = build()
        n = calls_for(functools.partial(cloudpickle.dumps, obj), budget)
        names = list(libs)
        times: dict[str, list[float]] = {k: [] for k in names}
        for rep in range(reps):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                dumps = libs[name]
                t0 = time.process_time()
                for _ in range(n):
                    dumps(obj)
                times[name].append((time.process_time() - t0) / n)
        size = {k: len(libs[k](obj)) for k in ("cadence", "cloudpickle")}
        rows.append(
            timed_row(case, times, mine="cadence", ref="cloudpickle", ref_b="cloudpickle_b",
                      target=TIME_TARGET, metric="dumps time")
        )  # fmt: skip
        rows.append(
            {
                "case": case,
                "metric": "payload size",
                "ratio": ratio_summary([size["cadence"] / size["cloudpickle"]]),
                "aa": None,
                "target": SIZE_TARGET,
                "extra": {
                    "bytes_cadence": size["cadence"],
                    "bytes_cloudpickle": size["cloudpickle"],
                },
            }
        )
    return make_record(
        "pickle",
        quick=quick,
        rows=rows,
        load_before=load0,
        settings={
            "reps": reps,
            "cloudpickle": cloudpickle.__version__,
            "clock": "process CPU time",
        },
    )
