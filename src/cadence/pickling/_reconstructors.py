"""Reconstructors and state setters for code, functions, modules, classes and typing objects.

These are the functions a payload calls while it loads. A payload names each one as
``cadence.pickling._reconstructors.<name>``, so names and signatures are part of the
payload format.

[Note: payload format] Never rename or remove a reconstructor, and never change what
its arguments mean. A change that old payloads cannot follow gets a new name; the old
name stays, either still working or replaced by a function that raises
`IncompatiblePayloadError` saying which cadence release stopped reading it. The frozen
payloads under ``tests/pickling/old_pickles`` and the test that loads them enforce this.

Each by-value object is rebuilt in two steps. A *skeleton* (``_make_*``) is created and
memoized first; its *state* (``_*_setstate``) is applied afterwards, so state that points
back at the object (a recursive closure, ``wrapper.me = wrapper``, a method's
``__class__`` cell) finds it in the memo instead of recursing forever.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import sys
import types
import typing
from typing import Any

from cadence.pickling import _tracker
from cadence.pickling._errors import IncompatiblePayloadError

# Everything not listed here is private to cadence.pickling.
__all__ = [
    "_cell_setstate",
    "_class_setstate",
    "_dataclass_sentinel",
    "_function_setstate",
    "_import_module",
    "_make_cell",
    "_make_code",
    "_make_dynamic_module",
    "_make_function",
    "_make_newtype",
    "_make_skeleton_class",
    "_make_skeleton_enum",
    "_make_typevar",
    "_make_typing_param",
    "_module_setstate",
]


# ---------------------------------------------------------------------------------------
# Modules and sentinels
# ---------------------------------------------------------------------------------------


def _import_module(name: str) -> types.ModuleType:
    return importlib.import_module(name)


def _make_dynamic_module(name: str) -> types.ModuleType:
    # An empty module, memoized before its namespace (its state) is loaded, so a
    # function of the module that reads the module itself finds it in the memo. It is
    # not put in sys.modules: it stays dynamic, so pickling it again (in a worker that
    # forwards it) ships it by value again.
    module = types.ModuleType(name)
    module.__dict__["__builtins__"] = builtins
    return module


def _module_setstate(module: types.ModuleType, namespace: dict[str, Any]) -> None:
    module.__dict__.update(namespace)


def _dataclass_sentinel(name: str) -> Any:
    # dataclasses compares these by identity (``f._field_type is _FIELD``); a copy made
    # by value would make ``fields()`` of a rebuilt dataclass come back empty.
    return getattr(dataclasses, name)


# ---------------------------------------------------------------------------------------
# Code, cells and functions
# ---------------------------------------------------------------------------------------


def _make_code(version: tuple[int, int], args: tuple[Any, ...]) -> types.CodeType:
    # Bytecode does not cross minor versions (the marshal docs say so). Without this check
    # a 3.12 payload on 3.11 fails somewhere inside CodeType with a positional-arg error or,
    # worse, builds code that crashes the interpreter when called.
    here = tuple(sys.version_info[:2])
    if tuple(version) != here:
        raise IncompatiblePayloadError(
            f"this payload holds bytecode compiled by Python {version[0]}.{version[1]}, "
            f"but this is Python {here[0]}.{here[1]}: code objects do not cross Python "
            "versions; load it with the same Python version that dumped it"
        )
    return types.CodeType(*args)


def _make_cell() -> types.CellType:
    return types.CellType()


def _cell_setstate(cell: types.CellType, contents: Any) -> None:
    cell.cell_contents = contents


def _make_function(
    code: types.CodeType,
    base_globals: dict[str, Any],
    name: str | None,
    closure: tuple[types.CellType, ...] | None,
) -> types.FunctionType:
    # A function captures its builtins when it is created (3.10+), so they must be in
    # place now; the real module, never a pickled copy of its dict.
    base_globals.setdefault("__builtins__", builtins)
    return types.FunctionType(code, base_globals, name or code.co_name, None, closure)


_UNSET = object()


def _function_setstate(func: types.FunctionType, state: dict[str, Any]) -> None:
    """Apply a function's state once the function exists (and is memoized).

    ``globals`` goes into the shared rebuilt dict (other functions of the same module in
    this payload see the same dict); ``closure`` fills the cells, which are shared
    objects, so a cell shared by two functions stays shared. ``__dict__`` comes before
    ``__type_params__``: on 3.10/3.11 there is no slot for the latter and it lives in
    ``__dict__``.
    """
    g = state.get("@globals")
    if g:
        func.__globals__.update(g)
    closure = state.get("@closure")
    if closure:
        freevars = func.__code__.co_freevars
        cells = func.__closure__ or ()
        for name, value in closure.items():
            cells[freevars.index(name)].cell_contents = value
    d = state.get("@dict")
    if d:
        func.__dict__.update(d)
    tp = state.get("@type_params", _UNSET)
    if tp is not _UNSET:
        func.__type_params__ = tp  # type: ignore[attr-defined]  # typeshed has it from 3.12; mypy checks as 3.11
    if "@defaults" in state:
        func.__defaults__ = state["@defaults"]
    if "@kwdefaults" in state:
        func.__kwdefaults__ = state["@kwdefaults"]
    if "@doc" in state:
        func.__doc__ = state["@doc"]
    if "@annotations" in state:
        func.__annotations__ = state["@annotations"]
    if "@qualname" in state:
        func.__qualname__ = state["@qualname"]
    # None is what CPython gives a function defined where __name__ was unset;
    # typeshed types the attribute str.
    func.__module__ = state.get("@module")  # type: ignore[assignment]  # None is valid (see above)


# ---------------------------------------------------------------------------------------
# Classes (see [Note: tracker ids])
# ---------------------------------------------------------------------------------------


def _make_skeleton_class(
    metaclass: type,
    name: str,
    qualname: str,
    bases: tuple[type, ...],
    type_kwargs: dict[str, Any],
    tracker_id: str,
) -> type:
    existing: type | None = _tracker.lookup(tracker_id)
    if existing is not None:
        # Do not even build a throwaway skeleton: it would run the bases'
        # __init_subclass__ (plugin registries and the like) a second time.
        return existing

    def body(ns: dict[str, Any]) -> None:
        ns.update(type_kwargs)
        ns["__qualname__"] = qualname

    skeleton = types.new_class(name, bases, {"metaclass": metaclass}, body)
    tracked: type = _tracker.track(tracker_id, skeleton)
    return tracked


def _make_skeleton_enum(
    bases: tuple[type, ...],
    name: str,
    qualname: str,
    members: dict[str, Any],
    module: str,
    tracker_id: str,
) -> type:
    # Members must exist when the enum class is created (EnumMeta builds them in __new__),
    # so unlike other classes they travel with the skeleton, not the state.
    existing: type | None = _tracker.lookup(tracker_id)
    if existing is not None:
        return existing
    metacls = type(bases[-1])
    classdict = metacls.__prepare__(name, bases)
    for member_name, value in members.items():
        classdict[member_name] = value
    # EnumMeta needs the namespace its __prepare__ made (an _EnumDict, a dict
    # subclass); typeshed types __prepare__'s result as a MutableMapping.
    enum_class = metacls.__new__(metacls, name, bases, classdict)  # type: ignore[call-overload]  # EnumMeta's own namespace (see above)
    enum_class.__module__ = module
    enum_class.__qualname__ = qualname
    tracked: type = _tracker.track(tracker_id, enum_class)
    return tracked


def _class_setstate(cls: type, state: tuple[dict[str, Any], list[type]]) -> type:
    if _tracker.is_complete(cls):
        # The tracker handed back a class that already exists here (loaded before, or
        # the original): re-applying state would swap its methods for copies.
        return cls
    attrs, abc_registry = state
    for attr, value in attrs.items():
        setattr(cls, attr, value)
    for subclass in abc_registry:
        cls.register(subclass)  # type: ignore[attr-defined]  # cls is an ABCMeta class, typed as type
    _tracker.complete(cls)
    return cls


# ---------------------------------------------------------------------------------------
# Typing objects (tracked like classes)
# ---------------------------------------------------------------------------------------


def _make_typevar(
    name: str,
    bound: Any,
    constraints: tuple[Any, ...],
    covariant: bool,
    contravariant: bool,
    tracker_id: str,
) -> Any:
    existing = _tracker.lookup(tracker_id)
    if existing is not None:
        return existing
    # The name is data from the payload; mypy only models TypeVars named by a literal.
    tv = typing.TypeVar(  # type: ignore[misc]  # the name is data (see above)
        name, *constraints, bound=bound, covariant=covariant, contravariant=contravariant
    )
    return _tracker.track(tracker_id, tv)


def _make_typing_param(kind: str, name: str, options: dict[str, Any], tracker_id: str) -> Any:
    """A ``ParamSpec`` or ``TypeVarTuple`` (``kind`` names the class in ``typing``)."""
    existing = _tracker.lookup(tracker_id)
    if existing is not None:
        return existing
    factory = getattr(typing, kind, None)
    if kind not in ("ParamSpec", "TypeVarTuple") or factory is None:
        raise IncompatiblePayloadError(
            f"this payload holds a typing.{kind}, which this Python's typing module lacks"
        )
    return _tracker.track(tracker_id, factory(name, **options))


def _make_newtype(name: str, supertype: Any, module: str, tracker_id: str) -> Any:
    existing = _tracker.lookup(tracker_id)
    if existing is not None:
        return existing
    # The name is data from the payload; mypy only models NewTypes named by a literal.
    nt = typing.NewType(name, supertype)  # type: ignore[misc]  # the name is data (see above)
    nt.__module__ = module
    return _tracker.track(tracker_id, nt)
