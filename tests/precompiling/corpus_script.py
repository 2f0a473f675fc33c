"""Nested-function shapes used as helpers inside a compiled step, through three processes.

Run as a script (its helpers and classes live in ``__main__``)::

    python corpus_script.py compile WORKDIR   # eager reference, both serializers
    python corpus_script.py load WORKDIR      # a fresh interpreter, same script
    python corpus_script.py bytes WORKDIR     # a fresh cadence.launch rank: no user __main__

``compile`` precompiles every shape with cadence into ``WORKDIR/cache`` and, for
comparison, saves torch's own artifact (``aot_compile(...).save_compiled_function``,
compiled without cadence) into ``WORKDIR/torch``. ``load`` runs the same script again
(as a torchrun rank or a restarted job would): cadence through ``precompile`` (which must
come from the cache), torch through ``load_compiled_function``. ``bytes`` loads in a
`cadence.launch` rank, whose ``__main__`` is cadence's worker and which receives the
functions and inputs by value. Every load must give the eager loss and gradients.
Results go to ``WORKDIR/results-<phase>.json`` as ``{shape: {serializer: "ok" | error}}``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

import cadence
from cadence import pickling

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus_model import MLP

# aot_eager keeps CI fast. It stores its graph with plain pickle, which names a
# `__main__` model class by reference: a rank without the script cannot load that part
# whichever serializer wrote the rest, so the model is importable except in the one
# shape about `__main__` model classes. The docs' table is measured with inductor
# (`CORPUS_BACKEND=inductor`), whose artifacts hold no such reference.
BACKEND = os.environ.get("CORPUS_BACKEND", "aot_eager")
ONLY = [s for s in os.environ.get("CORPUS_ONLY", "").split(",") if s]


class MainMLP(MLP):
    """A model class defined in ``__main__`` (torch names it by reference)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5


@dataclasses.dataclass
class Cfg:
    scale: float = 1.5
    shift: float = 0.25


class Scaler:
    def __init__(self, k: float) -> None:
        self.k = k

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.k


SCALE = 0.5
main_lambda = lambda y: y * 3.0 + 1.0  # noqa: E731


def main_helper(y: torch.Tensor) -> torch.Tensor:
    return torch.sin(y) * SCALE


def scaled(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(y: torch.Tensor) -> torch.Tensor:
        return fn(y) * 2.0

    return wrapper


def base(y: torch.Tensor) -> torch.Tensor:
    return y + 1.0


module_wrapper = scaled(base)  # claims the name `base`: by reference it resolves wrong


def make_step(helper: Any) -> Any:
    def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return helper(model(x)).pow(2).mean()

    return step


def main_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return main_helper(model(x)).pow(2).mean()


def shape_closure_scalar() -> Any:
    k = 2.0
    return make_step(lambda y: y * k)


def shape_nested_helper() -> Any:
    def outer() -> Any:
        def inner(y: torch.Tensor) -> torch.Tensor:
            return torch.relu(y) + 0.5

        def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return inner(model(x)).pow(2).mean()

        return step

    return outer()


def shape_wraps_local() -> Any:
    def local(y: torch.Tensor) -> torch.Tensor:
        return y - 0.5

    return make_step(scaled(local))


def shape_partial_local() -> Any:
    def add(c: float, y: torch.Tensor) -> torch.Tensor:
        return y + c

    return make_step(functools.partial(add, 0.75))


def shape_recursive_closure() -> Any:
    def rec(y: torch.Tensor, n: int) -> torch.Tensor:
        return y if n == 0 else rec(y * 0.9, n - 1)

    return make_step(lambda y: rec(y, 3))


def shape_shared_cell() -> Any:
    count = 2.0

    def get() -> float:
        return count

    def bump() -> None:
        nonlocal count
        count += 1.0

    return make_step(lambda y: y * get())


def shape_defaults() -> Any:
    def helper(y: torch.Tensor, a: float = 2.0, *, b: float = 0.5) -> torch.Tensor:
        return y * a + b

    return make_step(helper)


def shape_local_class() -> Any:
    class Local:
        def __init__(self) -> None:
            self.k = 1.25

    cfg = Local()
    return make_step(lambda y: y * cfg.k)


def shape_lock_in_dict() -> Any:
    def helper(y: torch.Tensor) -> torch.Tensor:
        return y * 0.75

    helper.lock = threading.Lock()  # type: ignore[attr-defined]
    return make_step(helper)


def shape_empty_cell() -> Any:
    if False:
        unused = 1.0  # never assigned: the helper's cell stays empty

    def helper(y: torch.Tensor) -> torch.Tensor:
        if y is None:
            return unused  # type: ignore[return-value]
        return y + 2.0

    return make_step(helper)


SHAPES: dict[str, Any] = {
    "closure over a scalar": shape_closure_scalar,
    "nested helper": shape_nested_helper,
    "__main__ lambda": lambda: make_step(main_lambda),
    "functools.wraps wrapper (local)": shape_wraps_local,
    "functools.wraps wrapper (module level, name mismatch)": lambda: make_step(module_wrapper),
    "__main__ helper through globals": lambda: main_step,
    "__main__ dataclass instance": lambda: make_step(
        lambda y, cfg=Cfg(): y * cfg.scale + cfg.shift  # noqa: B008
    ),
    "local class instance": shape_local_class,
    "partial of a local function": shape_partial_local,
    "recursive closure": shape_recursive_closure,
    "cell shared by two functions": shape_shared_cell,
    "defaults and keyword-only defaults": shape_defaults,
    "bound method of a __main__ object": lambda: make_step(Scaler(0.5).apply),
    "unpicklable entry in a helper's __dict__": shape_lock_in_dict,
    "empty closure cell": shape_empty_cell,
    "compiled after a backward (parameters have .grad)": lambda: make_step(torch.sigmoid),
    "__main__ nn.Module class as the model": lambda: make_step(torch.cos),
}
MAIN_MODEL = "__main__ nn.Module class as the model"
if ONLY:
    SHAPES = {k: v for i, (k, v) in enumerate(SHAPES.items()) if str(i) in ONLY}
# Every other shape is compiled with no gradients on the model, so that the table
# measures how each serializer handles the function, not torch's .grad bug.
AFTER_BACKWARD = {"compiled after a backward (parameters have .grad)"}


def _inputs(seed: int, name: str) -> tuple[MLP, torch.Tensor]:
    torch.manual_seed(seed)
    return (MainMLP() if name == MAIN_MODEL else MLP()), torch.randn(3, 4)


def _run(fn: Any, model: MLP, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss = fn(model, x)
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str:
    for name, value in want.items():
        if not torch.allclose(got[name], value, atol=1e-6, rtol=0):
            return f"wrong {name}: {got[name]} vs {value}"
    return "ok"


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def phase_compile(work: Path) -> dict[str, dict[str, str]]:
    results: dict[str, dict[str, str]] = {}
    expected: dict[str, dict[str, torch.Tensor]] = {}
    (work / "torch").mkdir(parents=True, exist_ok=True)
    for i, (name, make) in enumerate(SHAPES.items()):
        step = make()
        model, x = _inputs(i, name)
        expected[name] = _run(step, model, x)
        if name not in AFTER_BACKWARD:
            model.zero_grad(set_to_none=True)
        row = results.setdefault(name, {})
        try:
            compiled = cadence.precompile(
                step, (model, x), cache_dir=work / "cache", backend=BACKEND
            )
            row["cadence"] = _same(_run(compiled, model, x), expected[name])
        except Exception as exc:
            row["cadence"] = _error(exc)
        model.zero_grad(set_to_none=name not in AFTER_BACKWARD)
        try:
            aot = torch.compile(step, fullgraph=True, backend=BACKEND).aot_compile(((model, x), {}))
            aot.save_compiled_function(str(work / "torch" / f"{i}.bin"))
            row["torch"] = "ok"
        except Exception as exc:
            row["torch"] = _error(exc)
    torch.save(expected, work / "expected.pt")
    return results


def phase_load(work: Path) -> dict[str, dict[str, str]]:
    expected = torch.load(work / "expected.pt")
    results: dict[str, dict[str, str]] = {}
    for i, (name, make) in enumerate(SHAPES.items()):
        step = make()
        model, x = _inputs(i, name)
        row = results.setdefault(name, {})
        row["cadence"] = _cadence_load(step, model, x, work, expected[name])
        row["torch"] = _torch_load(work, i, model, x, expected[name])
    return results


def _cadence_load(step: Any, model: Any, x: Any, work: Path, want: dict[str, Any]) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", cadence.precompiling.CacheRefusedWarning)
        try:
            compiled = cadence.precompile(
                step, (model, x), cache_dir=work / "cache", backend=BACKEND
            )
        except Exception as exc:
            compiled, error = None, _error(exc)
    refused = [
        str(w.message) for w in caught if w.category is cadence.precompiling.CacheRefusedWarning
    ]
    if compiled is None or compiled.source != "cache":
        source = error if compiled is None else compiled.source
        return f"not from the cache ({source}; refused: {refused})"
    return _same(_run(compiled, model, x), want)


def _torch_load(work: Path, i: int, model: Any, x: Any, want: dict[str, torch.Tensor]) -> str:
    path = work / "torch" / f"{i}.bin"
    if not path.exists():
        return "not saved"
    try:
        with open(path, "rb") as f:
            fn = torch.compiler.load_compiled_function(f)
        return _same(_run(fn, model, x), want)
    except Exception as exc:
        return _error(exc)


def _bytes_only(work: str, cases: list[tuple[str, bytes]]) -> dict[str, dict[str, str]]:
    """Runs in a cadence.launch rank: the shapes and inputs arrive by value."""
    warnings.simplefilter("ignore")
    root = Path(work)
    expected = torch.load(root / "expected.pt")
    results: dict[str, dict[str, str]] = {}
    for i, (name, blob) in enumerate(cases):
        row = results.setdefault(name, {})
        step, model, x = pickling.loads(blob)
        row["cadence"] = _cadence_load(step, model, x, root, expected[name])
        row["torch"] = _torch_load(root, i, model, x, expected[name])
    return results


def phase_bytes(work: Path) -> dict[str, dict[str, str]]:
    cases = []
    for i, (name, make) in enumerate(SHAPES.items()):
        cases.append((name, pickling.dumps((make(), *_inputs(i, name)))))
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    (result,) = cadence.launch(
        _bytes_only, str(work), cases, nprocs=1, init_process_group=False, env=env, timeout=600
    )
    return result  # type: ignore[no-any-return]


def main() -> None:
    phase, work = sys.argv[1], Path(sys.argv[2])
    warnings.simplefilter("ignore")
    run = {"compile": phase_compile, "load": phase_load, "bytes": phase_bytes}[phase]
    try:
        results = run(work)
    except Exception:
        traceback.print_exc()
        raise
    (work / f"results-{phase}.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
