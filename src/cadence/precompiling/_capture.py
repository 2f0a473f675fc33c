"""What a function reaches besides its arguments: frozen state, code digests, watched values.

`capture(fn)` walks from ``fn`` through its closure cells, the globals its code reads
(nested code included), its defaults, ``functools.partial`` arguments, bound methods and
the functions, containers and plain objects found there. It answers three questions:

* **Frozen state.** A tensor, a Parameter or a module holding either, reached this way,
  would be pickled into the artifact, and the loaded function would silently compute with
  that copy: no optimizer update reaches it, no gradient leaves it. Each one is reported
  with its path (``step.__closure__ 'w'``, ``global W``) so precompile can refuse it.
  Functions that go by reference (importable, not ``__main__``) are not searched for
  frozen state: the compiled code reaches their globals through an import at load, live.
* **Code digests.** Every function and class the walk reaches, library code excepted,
  with a digest of its bytecode, names and constants. The cache key carries them, so an
  edited helper, step or model class invalidates the artifact. Line numbers are left out:
  moving code does not change what it computes.
* **Watched values.** A global or closure value is read when the function is traced and
  baked into the graph; torch keeps no guard on globals in an AOT artifact. Every
  captured global and cell is watched by identity, and the scalars inside captured
  containers and plain objects by value, so a later rebinding (``SCALE = 3.0``) fails
  the call loudly instead of running the stale constant.
"""

from __future__ import annotations

import dis
import functools
import hashlib
import importlib
import os
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from cadence import pickling

__all__ = [
    "Capture",
    "Watched",
    "capture",
    "class_digest",
    "frozen_in",
    "module_class_digests",
    "resolves_by_name",
]

_MAX_NODES = 20_000
_MAX_DEPTH = 8
_MAX_WATCHED = 512
_SCALARS = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)
_MISSING = object()


@dataclass
class Watched:
    """One captured value: ``read()`` must still give ``expected`` (identity, or equality
    with the same type for scalars)."""

    label: str
    read: Callable[[], Any]
    expected: Any
    by_value: bool

    def changed(self) -> bool:
        try:
            now = self.read()
        except Exception:
            now = _MISSING
        if now is self.expected:
            return False
        if not self.by_value:
            return True
        return type(now) is not type(self.expected) or now != self.expected


@dataclass
class Capture:
    """What `capture` found.

    ``code`` maps each reached function or class to its digest, ``values`` each captured
    scalar (the constants the trace bakes in) to its ``repr``. ``identity`` is the part of
    both reached through the function's own closure cells, defaults and partial
    arguments: it tells apart two functions made by one factory (``make_step(a)`` and
    ``make_step(b)`` share a name and code but not their closures).
    """

    frozen: list[str] = field(default_factory=list)
    code: dict[str, str] = field(default_factory=dict)
    values: dict[str, str] = field(default_factory=dict)
    identity: dict[str, str] = field(default_factory=dict)
    watched: list[Watched] = field(default_factory=list)

    def changed(self) -> list[str]:
        """Labels of watched values that differ from what was captured."""
        return [w.label for w in self.watched if w.changed()]


# ---------------------------------------------------------------------------------------
# Library code and by-value decisions
# ---------------------------------------------------------------------------------------

_LIBRARY_ROOTS = tuple(
    os.path.realpath(p)
    for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if p
)
_THIRD_PARTY = frozenset({"torch", "numpy", "sympy", "triton", "functorch", "typing_extensions"})


@functools.cache
def _is_library(module_name: str | None) -> bool:
    if not isinstance(module_name, str) or module_name == "__main__":
        return False
    top = module_name.partition(".")[0]
    if top in sys.stdlib_module_names or top in _THIRD_PARTY or top == "builtins":
        return True
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if not path:
        return False
    real = os.path.realpath(path)
    return any(real.startswith(root + os.sep) for root in _LIBRARY_ROOTS)


def resolves_by_name(obj: Any) -> bool:
    """Does importing ``obj.__module__`` and walking ``obj.__qualname__`` give ``obj``?"""
    try:
        target: Any = importlib.import_module(obj.__module__)
        for part in obj.__qualname__.split("."):
            target = getattr(target, part)
    except Exception:
        return False
    return target is obj


def _by_value(obj: Any) -> bool:
    """Would a by-value pickler carry ``obj`` (a function or class) by value?"""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", "")
    if not isinstance(module, str) or module == "__main__" or "<locals>" in qualname:
        return True
    registered = pickling.list_registry_pickle_by_value()
    if any(module == m or module.startswith(m + ".") for m in registered):
        return True
    return not resolves_by_name(obj)


# ---------------------------------------------------------------------------------------
# Digests
# ---------------------------------------------------------------------------------------


def _const_repr(value: Any) -> bytes:
    if isinstance(value, (frozenset, set)):
        return b"{" + b",".join(sorted(_const_repr(v) for v in value)) + b"}"
    if isinstance(value, tuple):
        return b"(" + b",".join(_const_repr(v) for v in value) + b")"
    return f"{type(value).__name__}:{value!r}".encode()


def _digest_code(code: types.CodeType, h: Any) -> None:
    h.update(code.co_code)
    for names in (code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars):
        h.update(repr(names).encode())
    h.update(repr((code.co_argcount, code.co_kwonlyargcount, code.co_flags)).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _digest_code(const, h)
        else:
            h.update(_const_repr(const))


def _function_digest(fn: types.FunctionType) -> str:
    h = hashlib.sha256()
    _digest_code(fn.__code__, h)
    for default in (fn.__defaults__ or ()) + tuple((fn.__kwdefaults__ or {}).items()):
        if isinstance(default, (*_SCALARS, tuple)):
            h.update(_const_repr(default))
    return h.hexdigest()[:32]


def class_digest(cls: type) -> str:
    """Digest of the methods a class defines itself (and its non-library bases)."""
    h = hashlib.sha256(cls.__qualname__.encode())
    for klass in cls.__mro__:
        if _is_library(klass.__module__):
            continue
        for name in sorted(vars(klass)):
            value = vars(klass)[name]
            func = getattr(value, "__func__", value)
            if isinstance(func, types.FunctionType):
                h.update(name.encode())
                _digest_code(func.__code__, h)
            elif isinstance(value, property) and isinstance(value.fget, types.FunctionType):
                h.update(name.encode())
                _digest_code(value.fget.__code__, h)
            elif isinstance(value, _SCALARS):
                h.update(name.encode() + _const_repr(value))
    return h.hexdigest()[:32]


def module_class_digests(modules: list[torch.nn.Module]) -> dict[str, str]:
    """``{class name: digest}`` for the user classes of these modules and their children."""
    out: dict[str, str] = {}
    for root in modules:
        for sub in root.modules():
            cls = type(sub)
            for klass in cls.__mro__:
                if not _is_library(klass.__module__) and klass is not object:
                    out[f"class {klass.__module__}.{klass.__qualname__}"] = class_digest(klass)
    return out


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"})


def _global_names(code: types.CodeType) -> Iterator[str]:
    """Names the code reads as globals (not attribute names, which share ``co_names``)."""
    for ins in dis.get_instructions(code):
        if ins.opname in _GLOBAL_OPS:
            yield ins.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


# ---------------------------------------------------------------------------------------
# The walk
# ---------------------------------------------------------------------------------------


class _Walker:
    def __init__(self) -> None:
        self.out = Capture()
        self.seen: set[int] = set()
        self.nodes = 0
        self.in_identity = False  # walking the top function's closure, defaults, partial

    def record_code(self, name: str, digest: str) -> None:
        self.out.code[name] = digest
        if self.in_identity:
            self.out.identity[name] = digest

    def record_value(self, label: str, value: Any) -> None:
        text = _const_repr(value).decode()
        self.out.values[label] = text
        if self.in_identity:
            self.out.identity[label] = text

    def watch(self, label: str, read: Callable[[], Any], value: Any) -> None:
        if len(self.out.watched) < _MAX_WATCHED:
            by_value = isinstance(value, _SCALARS)
            self.out.watched.append(Watched(label, read, value, by_value))

    def function(self, fn: types.FunctionType, *, top: bool) -> None:
        if id(fn) in self.seen:
            return
        self.seen.add(id(fn))
        library = _is_library(fn.__module__)
        if not library:
            self.record_code(f"{fn.__module__}.{fn.__qualname__}", _function_digest(fn))
        elif not top:
            return
        carried = top or _by_value(fn)
        g = fn.__globals__
        here = fn.__qualname__
        for name in dict.fromkeys(_global_names(fn.__code__)):
            if name not in g:
                continue
            value = g[name]
            label = f"global {name}" if top else f"global {name} (read by {here})"
            # Watched and recorded even when ``fn`` goes by reference: the trace bakes
            # the values it reads into the graph wherever they live.
            self.watch(label, functools.partial(g.get, name, _MISSING), value)
            self.value(value, label, depth=0, carried=carried, names=fn.__code__.co_names)
        if not carried:
            return
        outer, self.in_identity = self.in_identity, self.in_identity or top
        try:
            self._closure_and_defaults(fn)
        finally:
            self.in_identity = outer

    def _closure_and_defaults(self, fn: types.FunctionType) -> None:
        here = fn.__qualname__
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell: nothing to carry
                continue
            label = f"{here}.__closure__ {name!r}"
            self.watch(label, functools.partial(getattr, cell, "cell_contents"), value)
            self.value(value, label, depth=0, carried=True)
        names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
        defaults = fn.__defaults__ or ()
        for name, value in zip(names[len(names) - len(defaults) :], defaults):
            self.value(value, f"{here} default of parameter {name!r}", depth=0, carried=True)
        for name, value in (fn.__kwdefaults__ or {}).items():
            self.value(value, f"{here} default of parameter {name!r}", depth=0, carried=True)

    def value(
        self,
        value: Any,
        label: str,
        *,
        depth: int,
        carried: bool,
        names: tuple[str, ...] = (),
    ) -> None:
        self.nodes += 1
        if self.nodes > _MAX_NODES or depth > _MAX_DEPTH:
            return
        if isinstance(value, _SCALARS):
            self.record_value(label, value)
            return
        if isinstance(value, torch.Tensor):
            if carried:
                kind = "Parameter" if isinstance(value, torch.nn.Parameter) else "tensor"
                shape = "x".join(map(str, value.shape)) or "scalar"
                self.out.frozen.append(f"{label} ({kind} {shape} {value.dtype})")
            return
        if isinstance(value, types.FunctionType):
            self.function(value, top=False)  # keeps its own `seen` entry
            return
        if id(value) in self.seen:
            return
        self.seen.add(id(value))
        if isinstance(value, types.MethodType):
            self.value(value.__func__, label, depth=depth, carried=carried)
            self.value(value.__self__, f"{label}.__self__", depth=depth + 1, carried=carried)
        elif isinstance(value, functools.partial):
            self.value(value.func, f"{label}.func", depth=depth + 1, carried=carried)
            for i, arg in enumerate(value.args):
                self.value(arg, f"{label}.args[{i}]", depth=depth + 1, carried=carried)
            for key, arg in value.keywords.items():
                self.value(arg, f"{label}.keywords[{key!r}]", depth=depth + 1, carried=carried)
        elif isinstance(value, torch.nn.Module):
            self._module(value, label, carried)
        elif isinstance(value, type):
            if not _is_library(value.__module__):
                self.record_code(
                    f"class {value.__module__}.{value.__qualname__}", class_digest(value)
                )
        elif isinstance(value, types.ModuleType):
            self._module_attributes(value, names)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for i, item in enumerate(value):
                self._item(value, i, item, f"{label}[{i}]", depth, carried)
        elif isinstance(value, dict):
            for key, item in list(value.items()):
                self._item(value, key, item, f"{label}[{key!r}]", depth, carried)
        elif not _is_library(type(value).__module__):
            # A plain object (a config, a dataclass instance) travels with its __dict__.
            attrs = getattr(value, "__dict__", None)
            if isinstance(attrs, dict):
                self.value(type(value), label, depth=depth + 1, carried=False)
                for key, item in list(attrs.items()):
                    self._item(value, key, item, f"{label}.{key}", depth, carried, attr=True)

    def _item(
        self,
        owner: Any,
        key: Any,
        item: Any,
        label: str,
        depth: int,
        carried: bool,
        attr: bool = False,
    ) -> None:
        if isinstance(item, _SCALARS) and not isinstance(owner, (tuple, frozenset)):
            if attr:
                self.watch(label, functools.partial(getattr, owner, key, _MISSING), item)
            elif not isinstance(owner, set):
                self.watch(label, functools.partial(_item_or_missing, owner, key), item)
        self.value(item, label, depth=depth + 1, carried=carried)

    def _module(self, module: torch.nn.Module, label: str, carried: bool) -> None:
        for name, digest in module_class_digests([module]).items():
            self.record_code(name, digest)
        if not carried:
            return
        state = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
        if state:
            shown = ", ".join(state[:3]) + (", ..." if len(state) > 3 else "")
            self.out.frozen.append(
                f"{label} (nn.Module {type(module).__name__} holding {len(state)} "
                f"parameters/buffers: {shown})"
            )

    def _module_attributes(self, module: types.ModuleType, names: tuple[str, ...]) -> None:
        if _is_library(module.__name__):
            return
        for name in names:
            attr = getattr(module, name, None)
            if isinstance(attr, types.FunctionType):
                self.function(attr, top=False)
            elif isinstance(attr, type):
                self.value(attr, f"{module.__name__}.{name}", depth=1, carried=False)


def _item_or_missing(owner: Any, key: Any) -> Any:
    try:
        return owner[key]
    except (LookupError, TypeError):
        return _MISSING


def frozen_in(pairs: list[tuple[str, Any]]) -> list[str]:
    """Frozen state among ``(label, value)`` pairs (what a compiled artifact carries)."""
    walker = _Walker()
    for label, value in pairs:
        walker.value(value, label, depth=0, carried=True)
    return walker.out.frozen


def capture(fn: Callable[..., Any]) -> Capture:
    """Walk ``fn`` (a function, bound method or ``functools.partial``)."""
    walker = _Walker()
    if isinstance(fn, types.MethodType):
        walker.function(fn.__func__, top=True)  # type: ignore[arg-type]  # typeshed: __func__ is a Callable; here a function
    elif isinstance(fn, types.FunctionType):
        walker.function(fn, top=True)
    else:
        walker.in_identity = True
        walker.value(fn, getattr(fn, "__qualname__", type(fn).__name__), depth=0, carried=True)
    return walker.out
