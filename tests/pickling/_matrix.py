"""The behaviour table of docs/pickling.md, measured: cadence, cloudpickle and dill.

``python -m tests.pickling._matrix`` prints the table; ``--write`` puts it into
docs/pickling.md between its markers. test_docs_table.py checks the two agree, so the
table cannot drift from what the libraries do (with the pinned cloudpickle and dill).

Each case is a function of a `Lib` returning the cell: ``ok`` (the round trip ran and
the check passed), ``wrong`` (it ran, the loaded object is not right), ``fails (Error)``,
``n/a``, or a short word the row's text explains. Loads run in this process.
"""

import abc
import collections
import functools
import hashlib
import json
import pickle
import subprocess
import sys
import threading
import types
import typing
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "pickling.md"
START, END = "<!-- behaviour-table:start -->", "<!-- behaviour-table:end -->"


@dataclass(frozen=True)
class Lib:
    name: str
    dumps: Callable[..., bytes]
    loads: Callable[..., Any]


def libs() -> list[Lib]:
    import cloudpickle
    import dill

    from cadence import pickling

    return [
        Lib("cadence", pickling.dumps, pickle.loads),
        Lib("cloudpickle", cloudpickle.dumps, pickle.loads),
        Lib("dill", dill.dumps, dill.loads),
    ]


def _rt(lib: Lib, obj: Any, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lib.loads(lib.dumps(obj, **kw))


def _cell(run: Callable[[], Any]) -> str:
    # In a thread with a time limit: a library may rebuild a lock in the acquired state,
    # and the first use of the loaded object then blocks for ever ("hangs").
    out: list[str] = []

    def target() -> None:
        try:
            result = run()
        except Exception as exc:
            out.append(f"fails ({type(exc).__name__})")
            return
        out.append("ok" if result is True else "wrong" if result is False else str(result))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(5)
    return out[0] if out else "hangs"


CASES: list[tuple[str, str, Callable[[Lib], str]]] = []


def case(row: str, behaviour: str) -> Callable[[Callable[[Lib], Any]], Any]:
    def register(fn: Callable[[Lib], Any]) -> Any:
        CASES.append((row, behaviour, lambda lib: _cell(lambda: fn(lib))))
        return fn

    return register


# Functions and closures ----------------------------------------------------------------
@case("B1", "empty closure cell stays empty (`NameError`)")
def _b1(lib: Lib) -> bool:
    def make() -> Any:
        if False:
            unset = 1

        def f() -> Any:
            return unset

        return f

    try:
        _rt(lib, make())()
    except NameError:
        return True
    return False


@case("B2", "recursive closure")
def _b2(lib: Lib) -> bool:
    def make() -> Any:
        def fact(n: int) -> int:
            return 1 if n <= 1 else n * fact(n - 1)

        return fact

    return _rt(lib, make())(5) == 120


@case("B3", "closure cell shared by two functions stays shared")
def _b3(lib: Lib) -> bool:
    def make() -> Any:
        c = 0

        def inc() -> None:
            nonlocal c
            c += 1

        def get() -> int:
            return c

        return inc, get

    inc, get = _rt(lib, make())
    inc()
    return get() == 1


@case("B4", "keyword-only defaults (`__kwdefaults__`)")
def _b4(lib: Lib) -> bool:
    def f(a: int, *, k: int = 2) -> int:
        return a * k

    return _rt(lib, f)(3) == 6


@case("B5", "defaults and positional-only arguments")
def _b5(lib: Lib) -> bool:
    def f(a: int, /, b: int = 3) -> int:
        return a + b

    g = _rt(lib, f)
    return g(1) == 4 and g.__code__.co_posonlyargcount == 1


@case("B6", "unpicklable `__dict__` entry (a lock) on a function")
def _b6(lib: Lib) -> str:
    def h() -> int:
        return 1

    h.lock = threading.Lock()  # type: ignore[attr-defined]
    loaded = _rt(lib, h)
    return "pruned, warns" if not hasattr(loaded, "lock") and loaded() == 1 else "ok"


@case("B7", "`functools.wraps` wrapper whose wrappee holds a lock")
def _b7(lib: Lib) -> str:
    def base() -> int:
        return 1

    base.lock = threading.Lock()  # type: ignore[attr-defined]
    wrapper = functools.wraps(base)(lambda: base() + 1)
    loaded = _rt(lib, wrapper)
    return "pruned, warns" if not hasattr(loaded.__wrapped__, "lock") else "ok"


@case("B8", "`__doc__` that is not a string (a lock)")
def _b8(lib: Lib) -> str:
    def f() -> int:
        return 1

    f.__doc__ = threading.Lock()  # type: ignore[assignment]
    loaded = _rt(lib, f)
    return "pruned, warns" if loaded.__doc__ is None and loaded() == 1 else "ok"


@case("B9", "annotation naming a local class")
def _b9(lib: Lib) -> bool:
    class Cfg:
        pass

    def inner(x: Cfg) -> int:
        return 1

    return _rt(lib, inner).__annotations__["x"].__name__ == "Cfg"


@case("B11", "`__type_params__` carried")
def _b11(lib: Lib) -> bool:
    def ident(x: Any) -> Any:
        return x

    ident.__type_params__ = (typing.TypeVar("T"),)  # type: ignore[attr-defined]
    return [t.__name__ for t in _rt(lib, ident).__type_params__] == ["T"]


@case("B12", "custom `__qualname__` kept")
def _b12(lib: Lib) -> bool:
    def q() -> int:
        return 1

    q.__qualname__ = "custom.qual"
    return _rt(lib, q).__qualname__ == "custom.qual"


@case("B13", "`wraps`-assigned `__qualname__` kept")
def _b13(lib: Lib) -> bool:
    def base() -> None: ...

    return _rt(lib, functools.wraps(base)(lambda: 1)).__qualname__ == base.__qualname__


@case("B14", "`__module__` None: by value, `__module__` kept")
def _b14(lib: Lib) -> bool:
    ns: dict[str, Any] = {"__name__": "matrix_exec_scope"}
    exec("def f(x):\n    return x * 2\n", ns)
    ns["f"].__module__ = None
    g = _rt(lib, ns["f"])
    return g.__module__ is None and g(4) == 8


@case("B15", "module-level `wraps` wrapper (claims another's name) by value")
def _b15(lib: Lib) -> bool:
    from tests.pickling.fixtures import fx_model

    loaded = _rt(lib, fx_model.h)
    return loaded is not fx_model.base and loaded(1) == fx_model.h(1)


@case("B16", "only the globals the code reads travel (not a 100k-element neighbour)")
def _b16(lib: Lib) -> str:
    from tests.pickling.fixtures import fx_model

    size = len(lib.dumps(fx_model.h))
    return "ok" if size < 5000 else f"ships {size // 1000} kB"


@case("B17", "globals: one shared namespace per payload, isolated from the module")
def _b17(lib: Lib) -> bool:
    ns: dict[str, Any] = {"__name__": "matrix_scope", "X": 0}
    exec("def bump():\n    global X\n    X += 1\ndef read():\n    return X\n", ns)
    bump, read = _rt(lib, (ns["bump"], ns["read"]))
    bump()
    return read() == 1 and ns["X"] == 0


@case("B18", "builtins of a rebuilt function are the real `builtins`")
def _b18(lib: Lib) -> bool:
    import builtins

    def f() -> int:
        return sum(range(10))

    g = _rt(lib, f)
    return g() == 45 and g.__globals__.get("__builtins__") in (builtins, builtins.__dict__)


@case("B19", "modules by reference; a `types.ModuleType` module by value")
def _b19(lib: Lib) -> bool:
    mod = types.ModuleType("matrix_dynamic")
    exec("X = 40\ndef answer():\n    return X + 2\n", mod.__dict__)
    loaded_json, loaded_mod = _rt(lib, (json, mod))
    return loaded_json is json and loaded_mod is not mod and loaded_mod.answer() == 42


@case("B20", "submodule reached by attribute, imported again at load")
def _b20(lib: Lib) -> bool:
    import xml.etree.ElementTree  # noqa: F401  (the function reaches it as xml.etree...)

    def scope() -> Any:
        import xml

        def example() -> Any:
            return xml.etree.ElementTree.Comment

        return example

    data = lib.dumps(scope())
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] == "xml"}
    try:
        return lib.loads(data)() is sys.modules["xml.etree.ElementTree"].Comment
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] == "xml"]:
            del sys.modules[k]
        sys.modules.update(saved)


@case("B22", "hand-built bound method (`types.MethodType(f, obj)`)")
def _b22(lib: Lib) -> bool:
    class State:
        n = 3

    def on_step(self: Any, k: int) -> int:
        return self.n * k

    return _rt(lib, types.MethodType(on_step, State()))(2) == 6


@case("B23", "receiver's property named like the method is not run")
def _b23(lib: Lib) -> bool:
    calls: list[int] = []

    def step(self: Any) -> str:
        return "method"

    class Receiver:
        @property
        def step(self) -> Any:
            calls.append(1)
            return lambda: "property"

    return _rt(lib, types.MethodType(step, Receiver()))() == "method" and not calls


@case("B24", "generator refused, error names where it sits")
def _b24(lib: Lib) -> str:
    gen = (i for i in range(3))
    try:
        lib.dumps(lambda: gen)
    except Exception as exc:
        return "ok" if "__closure__" in str(exc) else "no path"
    return "no error"


@case("B29", "unpicklable value deep in a closure: error names the path")
def _b29(lib: Lib) -> str:
    cfg = types.SimpleNamespace(lock=threading.Lock())
    try:
        lib.dumps(lambda: cfg)
    except Exception as exc:
        return "ok" if "__closure__['cfg'].lock" in str(exc) else "no path"
    return "no error (copies the lock)"


@case("B29", "deeply nested data: `PicklingError`, not `RecursionError`")
def _b29_recursion(lib: Lib) -> str:
    deep: list[Any] = []
    node = deep
    for _ in range(sys.getrecursionlimit() * 2):
        node.append([])
        node = node[0]
    try:
        lib.dumps(deep)
    except pickle.PicklingError as exc:
        return "ok" if "reached via" in str(exc) else "ok, no path"
    except RecursionError:
        return "fails (RecursionError)"
    return "ok"


# Classes and typing ---------------------------------------------------------------------
@case("B25", "module-level lambda")
def _b25(lib: Lib) -> bool:
    from tests.pickling.fixtures import fx_model

    return _rt(lib, fx_model.mod_lambda)(4) == 12


@case("B26", "`functools.partial` of a local function")
def _b26(lib: Lib) -> bool:
    def add(a: int, b: int) -> int:
        return a + b

    return _rt(lib, functools.partial(add, 1))(2) == 3


@case("B21", "local class with `super()`, instance round trip")
def _b21(lib: Lib) -> bool:
    class Base:
        def who(self) -> str:
            return "base"

    class Child(Base):
        def who(self) -> str:
            return "child of " + super().who()

    return _rt(lib, Child()).who() == "child of base"


@case("B31", "local ABC with `abc.abstractclassmethod` (deprecated form)")
def _abstract(lib: Lib) -> bool:
    class Shape(abc.ABC):
        @abc.abstractclassmethod  # type: ignore[misc]
        def make(cls) -> Any: ...

    class Square(Shape):
        @classmethod
        def make(cls) -> Any:
            return cls()

    return isinstance(_rt(lib, Square).make(), Shape)


@case("B32", "local class with `functools.cached_property`")
def _cached(lib: Lib) -> bool:
    class Lazy:
        @functools.cached_property
        def value(self) -> int:
            return 7

    return _rt(lib, Lazy)().value == 7


@case("B33", "local class annotated with itself and a local generic")
def _hints(lib: Lib) -> bool:
    T = typing.TypeVar("T")

    class Box(typing.Generic[T]):
        pass

    class Node:
        def link(self, other: "Node") -> Box[int]:  # type: ignore[empty-body]
            ...

    Node.__annotations__ = {"next": Node}
    loaded = _rt(lib, Node)
    return (
        loaded.__annotations__["next"] is loaded
        and loaded.link.__annotations__["return"] == (Box[int])
    )


@case("B34", "`TypeVar`: one object after two loads (tracked)")
def _typevar(lib: Lib) -> bool:
    tv = typing.TypeVar("TV")
    return _rt(lib, tv) is _rt(lib, tv)


@case("B35", "local `ParamSpec` and `NewType`")
def _paramspec(lib: Lib) -> bool:
    p, n = _rt(lib, (typing.ParamSpec("P"), typing.NewType("UserId", int)))
    return p.__name__ == "P" and n(3) == 3


# Built-in objects -----------------------------------------------------------------------
@case("B36", "dict views and `OrderedDict` views keep their type")
def _views(lib: Lib) -> bool:
    d, od = {"a": 1}, collections.OrderedDict(a=1)
    views = (d.keys(), d.values(), d.items(), od.keys(), od.values(), od.items())
    return [type(v) for v in _rt(lib, views)] == [type(v) for v in views]


@case("B37", "memoryview comes back as a memoryview (format, shape)")
def _memoryview(lib: Lib) -> str:
    view = memoryview(bytearray(range(8))).cast("i", (2,))
    loaded = _rt(lib, view)
    if type(loaded) is memoryview:
        return "ok" if (loaded.format, loaded.shape) == ("i", (2,)) else "wrong"
    return f"as {type(loaded).__name__}"


@case("B38", "memoryview out of band under protocol 5 (zero-copy)")
def _oob(lib: Lib) -> str:
    backing = bytearray(1 << 16)
    buffers: list[Any] = []
    data = lib.dumps(memoryview(backing), protocol=5, buffer_callback=buffers.append)
    if not buffers:
        return "copied in band"
    loaded = lib.loads(data, buffers=buffers)
    backing[0] = 7
    return loaded[0] == 7 and len(data) < 1000


@case("B39", "torch CPU tensor out of band under protocol 5 (zero-copy)")
def _tensor(lib: Lib) -> str:
    import torch

    t = torch.arange(1 << 14, dtype=torch.float32)
    buffers: list[Any] = []
    data = lib.dumps(t, protocol=5, buffer_callback=buffers.append)
    if not buffers:
        return "copied in band"
    return lib.loads(data, buffers=buffers).data_ptr() == t.data_ptr()


@case("B40", "`float.real`, `float.__dict__['fromhex']`, `type.__basicsize__` descriptors")
def _descriptors(lib: Lib) -> bool:
    descs = (float.real, float.__dict__["fromhex"], type.__dict__["__basicsize__"])
    return all(a is b for a, b in zip(_rt(lib, descs), descs))


@case("B41", "`weakref.WeakSet` members keep identity")
def _weakset(lib: Lib) -> bool:
    class Item:
        pass

    a, b = Item(), Item()
    ws, a2, b2 = _rt(lib, [weakref.WeakSet([a, b]), a, b])
    return set(ws) == {a2, b2}


@case("B42", "module registered by value, as a module, where it cannot be imported")
def _registered_module(lib: Lib) -> str:
    if lib.name == "dill":
        return "n/a"
    from tests.pickling.fixtures import fx_local_only as mod

    api = sys.modules["cadence.pickling" if lib.name == "cadence" else lib.name]
    api.register_pickle_by_value(mod)
    try:
        data = lib.dumps(mod)
    finally:
        api.unregister_pickle_by_value(mod)
    saved = sys.modules.pop(mod.__name__)
    try:
        loaded = lib.loads(data)
    finally:
        sys.modules[mod.__name__] = saved
    return type(loaded) is types.ModuleType and loaded is not mod and loaded.helper(1) == 11


# Determinism (children with different hash seeds) ----------------------------------------
_SEED_CHILD = """
import hashlib, json, sys
sys.path[:0] = {paths!r}
from tests.pickling._matrix import libs
words = frozenset(f"w{{i}}" for i in range(24))

def make():
    class Local:
        names = words
    return Local

out = {{lib.name: hashlib.sha256(lib.dumps((words, make()), protocol=4)).hexdigest()
        for lib in libs()}}
sys.stdout.write(json.dumps(out))
"""


def _seed_digests() -> dict[str, set[str]]:
    code = _SEED_CHILD.format(paths=[str(ROOT / "src"), str(ROOT)])
    runs = []
    for seed in ("0", "1", "2", "3"):
        env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              check=True, timeout=120)  # fmt: skip
        runs.append(json.loads(proc.stdout))
    return {name: {run[name] for run in runs} for name in runs[0]}


def table() -> str:
    measured = libs()
    import torch  # noqa: F401  (imported before the timed cells: it takes seconds)

    rows = [(row, behaviour, [run(lib) for lib in measured]) for row, behaviour, run in CASES]
    digests = _seed_digests()
    cells = [("ok" if len(digests[lib.name]) == 1 else f"{len(digests[lib.name])} payloads")
             for lib in measured]  # fmt: skip
    rows.append(("B30", "same bytes under 4 `PYTHONHASHSEED`s (local class, set of str)", cells))
    lines = ["| | behaviour | " + " | ".join(lib.name for lib in measured) + " |",
             "| --- | --- | " + " | ".join("---" for _ in measured) + " |"]  # fmt: skip
    for row, behaviour, cells in sorted(rows, key=lambda r: int(r[0][1:])):
        lines.append(f"| {row} | {behaviour} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def docs_table() -> str:
    text = DOC.read_text()
    return text[text.index(START) + len(START) : text.index(END)].strip()


def main() -> None:
    measured = table()
    if "--write" in sys.argv:
        text = DOC.read_text()
        head, rest = text.split(START, 1)
        DOC.write_text(f"{head}{START}\n{measured}\n{END}{rest.split(END, 1)[1]}")
    print(measured)
    print("\n" + hashlib.sha256(measured.encode()).hexdigest()[:12])


if __name__ == "__main__":
    main()
