"""``cadence bench pickle --loads --dill --out-of-band``: more of the pickler than dumps.

One process; `cadence.bench.pickler`'s code corpus, with each library's defaults.
``loads`` times the unpickling of each library's payload too; ``dill`` adds dill beside
cadence (its rows are dill / cloudpickle); ``out_of_band`` adds large buffers (a
memoryview, a numpy array and a torch CPU tensor) pickled under protocol 5 with a
``buffer_callback``, where zero-copy matters: the payload is the in-band bytes, and
the bytes handed to the callback are listed beside it. Per repetition each library
(and a second cloudpickle, the A/A) runs a fixed number of calls (enough for ~20 ms),
the order rotated per repetition; time is CPU time of this process, so the other work
on a shared machine does not favour whichever library ran in a quiet moment. A
library that cannot pickle an object (dill a memoryview) is listed under ``failed``
in the settings instead of a row.
"""

from __future__ import annotations

import functools
import pickle
import time
from collections.abc import Callable, Mapping
from typing import Any

from cadence.bench._loop import loadavg
from cadence.bench._record import make_record, ratio_summary, timed_row
from cadence.bench.pickler import CORPUS, SIZE_TARGET, TIME_TARGET, calls_for

__all__ = ["BUFFERS", "run"]


def _memoryview(mb: int) -> Any:
    return memoryview(bytearray(mb << 20)).cast("d")


def _numpy(mb: int) -> Any:
    import numpy as np

    return np.ones(mb << 17, dtype=np.float64)  # 8 bytes each


def _tensor(mb: int) -> Any:
    import torch

    return torch.ones(mb << 18, dtype=torch.float32)  # 4 bytes each


BUFFERS: dict[str, Callable[[int], Any]] = {
    "memoryview": _memoryview,
    "numpy array": _numpy,
    "torch tensor": _tensor,
}


def _libraries(dill: bool) -> dict[str, tuple[Callable[..., bytes], Callable[..., Any]]]:
    """name -> (dumps, loads); ``cloudpickle_b`` is the A/A copy."""
    try:
        import cloudpickle
    except ImportError as exc:
        raise ImportError(
            "cadence bench pickle compares against cloudpickle: pip install cloudpickle"
        ) from exc
    from cadence import pickling

    libs: dict[str, tuple[Callable[..., bytes], Callable[..., Any]]] = {
        "cadence": (pickling.dumps, pickle.loads),
        "cloudpickle": (cloudpickle.dumps, pickle.loads),
        "cloudpickle_b": (cloudpickle.dumps, pickle.loads),
    }
    if dill:
        try:
            import dill as dill_module  # type: ignore[import-untyped]
        except ImportError as exc:
            raise ImportError("--dill compares against dill: pip install dill") from exc
        libs["dill"] = (dill_module.dumps, dill_module.loads)
    return libs


def _times(
    calls: Mapping[str, Callable[[], Any]], reps: int, budget: float
) -> dict[str, list[float]]:
    """CPU seconds per call of each function, per repetition, the order rotated."""
    n = {k: calls_for(f, budget) for k, f in calls.items()}
    names = list(calls)
    out: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.process_time()
            for _ in range(n[name]):
                calls[name]()
            out[name].append((time.process_time() - t0) / n[name])
    return out


def _case_rows(
    case: str,
    obj: Any,
    libs: dict[str, tuple[Callable[..., bytes], Callable[..., Any]]],
    *,
    oob: bool,
    loads: bool,
    reps: int,
    budget: float,
    failed: dict[str, str],
) -> list[dict[str, Any]]:
    payloads: dict[str, tuple[bytes, list[Any]]] = {}
    for lib, (dumps, _) in libs.items():
        buffers: list[Any] = []
        kw: dict[str, Any] = {"protocol": 5, "buffer_callback": buffers.append} if oob else {}
        try:
            payloads[lib] = (dumps(obj, **kw), buffers)
        except Exception as exc:  # a library that cannot pickle it: say so, measure the rest
            failed[f"{case}, {lib}"] = type(exc).__name__
    if "cadence" not in payloads or "cloudpickle" not in payloads:
        return []
    ok = [lib for lib in libs if lib in payloads]
    oob_kw: dict[str, Any] = {"protocol": 5, "buffer_callback": [].append} if oob else {}
    phases = {"dumps time": {lib: functools.partial(libs[lib][0], obj, **oob_kw) for lib in ok}}
    if loads:
        phases["loads time"] = {
            lib: functools.partial(libs[lib][1], payloads[lib][0],
                                   **({"buffers": payloads[lib][1]} if oob else {}))
            for lib in ok
        }  # fmt: skip
    size = {lib: len(payloads[lib][0]) for lib in ok}
    oob_bytes = {lib: sum(memoryview(b).nbytes for b in payloads[lib][1]) for lib in ok}
    rows = []
    mine = [lib for lib in ok if lib in ("cadence", "dill")]
    for metric, calls in phases.items():
        times = _times(calls, reps, budget)
        for lib in mine:
            rows.append(
                timed_row(case if lib == "cadence" else f"{case} [dill]", times, mine=lib,
                          ref="cloudpickle", ref_b="cloudpickle_b", target=TIME_TARGET,
                          metric=metric)
            )  # fmt: skip
    for lib in mine:
        rows.append(
            {
                "case": case if lib == "cadence" else f"{case} [dill]",
                "metric": "payload size (in band)" if oob else "payload size",
                "ratio": ratio_summary([max(size[lib], 1) / max(size["cloudpickle"], 1)]),
                "aa": None,
                "target": SIZE_TARGET,
                "extra": {"bytes": size[lib], "bytes_cloudpickle": size["cloudpickle"]}
                | ({"oob_bytes": oob_bytes[lib]} if oob else {}),
            }
        )
    return rows


def run(
    *,
    quick: bool,
    tiny: bool = False,
    loads: bool = False,
    dill: bool = False,
    out_of_band: bool = False,
) -> dict[str, Any]:
    """Run the comparison and return its record (not yet written)."""
    libs = _libraries(dill)
    reps = 3 if tiny else 5 if quick else 7
    budget = 0.001 if tiny else 0.02
    size_mb = 1 if tiny else 16 if quick else 64
    load0 = loadavg()
    failed: dict[str, str] = {}
    corpus: dict[str, Any] = dict(list(CORPUS.items())[:1]) if tiny else dict(CORPUS)
    objects: list[tuple[str, Callable[[], Any], bool]] = [(k, f, False) for k, f in corpus.items()]
    if out_of_band:
        objects += [(f"{k} {size_mb} MB (protocol 5, oob)", functools.partial(f, size_mb), True)
                    for k, f in BUFFERS.items()]  # fmt: skip
    rows = []
    for case, build, oob in objects:
        rows += _case_rows(case, build(), libs, oob=oob, loads=loads, reps=reps, budget=budget,
                           failed=failed)  # fmt: skip
    import cloudpickle

    settings: dict[str, Any] = {"reps": reps, "cloudpickle": cloudpickle.__version__,
                                "clock": "process CPU time", "loads": loads, "dill": dill,
                                "out_of_band": out_of_band, "failed": failed}  # fmt: skip
    if out_of_band:
        settings["buffer_mb"] = size_mb
    record = make_record("pickle-extended", quick=quick, rows=rows, load_before=load0,
                         settings=settings)  # fmt: skip
    record["what"] = "cadence (or dill, its rows marked [dill]) / cloudpickle"
    return record
