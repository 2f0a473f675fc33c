"""State getters and reducers.

A reducer takes the pickler and one object and returns what ``__reduce__`` would: a tuple
``(callable, args[, state, listitems, dictitems, state_setter])`` naming a reconstructor
from ``_reconstructors``. ``Pickler.reducer_override`` looks reducers up by exact type in
``REDUCERS``; classes (any metaclass) go to :func:`class_reduce`.

See [Note: slot policy] for which function slots may be pruned.
"""

from __future__ import annotations

import abc
import copyreg
import dataclasses
import enum
import sys
import types
import typing
from typing import TYPE_CHECKING, Any

from cadence.pickling import _reconstructors as R
from cadence.pickling._lookup import (
    code_attribute_names,
    code_global_names,
    find_submodules,
    is_registered_by_value,
    lookup_by_reference,
)

if TYPE_CHECKING:
    from cadence.pickling._pickler import Pickler

# Everything not listed here is private to cadence.pickling.
__all__ = ["REDUCERS", "canonical", "class_reduce", "function_reduce", "object_reduce"]

# [Note: slot policy] A rebuilt function needs its code, closure, ``__defaults__`` and
# ``__kwdefaults__`` to be called correctly: those slots are *call-critical* and never
# pruned; if one does not pickle, the dump fails and names the path. ``__dict__`` entries
# (``__wrapped__`` included), ``__doc__``, each annotation and ``__type_params__`` (as a
# whole) are *optional*: nothing needs them to call the function, so an entry that does
# not pickle is dropped with a ``PrunedSlotWarning`` naming it. ``OPTIONAL_SLOTS`` is the
# list the error-path walk consults to decide which edge may be pruned.
OPTIONAL_SLOTS = ("__dict__", "__doc__", "__annotations__", "__type_params__")

# ---------------------------------------------------------------------------------------
# Deterministic containers
# ---------------------------------------------------------------------------------------
# The C pickler writes a set in its hash order, which for ``str`` elements changes with
# PYTHONHASHSEED, and it never consults reducer_override for exact sets. So wherever a
# reducer hands values to the pickler (globals, closure contents, defaults, ``__dict__``,
# class attributes, code constants, the top-level object) a set is swapped for a proxy that
# reduces to ``set(sorted_elements)``. The proxy is cached per set, so a set reached twice
# is still one object in the payload. Sets nested inside lists or instance state are not
# reached this way (see docs/pickling.md, "Limits").


class _SortedSet:
    __slots__ = ("items", "kind")

    def __init__(self, kind: type, items: list[Any]) -> None:
        self.kind = kind
        self.items = items

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.kind, (self.items if self.kind is set else tuple(self.items),))


def _stable_sorted(values: Any) -> list[Any]:
    try:
        return sorted(values)
    except TypeError:  # mixed or unorderable elements: order by type, then repr
        return sorted(values, key=lambda v: (type(v).__qualname__, repr(v)))


def canonical(pickler: Pickler, value: Any) -> Any:
    t = type(value)
    if t is set or t is frozenset:
        proxy = pickler._set_proxies.get(id(value))
        if proxy is None:
            proxy = _SortedSet(t, _stable_sorted(value))
            pickler._set_proxies[id(value)] = proxy
            pickler._keepalive.append(value)
        return proxy
    if t is tuple and value:
        # Tuples are immutable, so a copy with proxies inside is safe; keep the original
        # when nothing changed so memoization still shares it.
        new = tuple(canonical(pickler, v) for v in value)
        if any(a is not b for a, b in zip(new, value)):
            return new
    return value


def _canonical_dict(pickler: Pickler, d: dict[Any, Any]) -> dict[Any, Any]:
    return {k: canonical(pickler, v) for k, v in d.items()}


_SET_TYPES = (set, frozenset)


def _has_set(values: Any) -> bool:
    return any(type(v) in _SET_TYPES for v in values)


_PLAIN_TYPES: dict[type, bool] = {}


def _is_plain_type(t: type) -> bool:
    if len(_PLAIN_TYPES) > 4096:  # bound the cache; dynamic classes come and go
        _PLAIN_TYPES.clear()
    return (
        t.__reduce_ex__ is object.__reduce_ex__
        and t.__reduce__ is object.__reduce__
        and getattr(t, "__getstate__", None) is getattr(object, "__getstate__", None)
        and not any("__slots__" in vars(k) for k in t.__mro__)
        and t not in copyreg.dispatch_table
    )


def object_reduce(pickler: Pickler, obj: Any) -> Any:
    """Any other object: its own reduce, with sets in its state made deterministic.

    Only objects without a ``copyreg`` / ``dispatch_table`` entry come here, so those
    tables keep their precedence. The state is copied only when it holds a set.
    """
    t = type(obj)
    plain = _PLAIN_TYPES.get(t)
    if plain is None:
        plain = _PLAIN_TYPES[t] = _is_plain_type(t)
    if plain:
        # The common instance: default reduce, state is its __dict__. Leave it to the C
        # pickler unless that dict holds a set.
        d = getattr(obj, "__dict__", None)
        if d is None or not _has_set(d.values()):
            return NotImplemented
    table = getattr(pickler, "dispatch_table", None)
    if t in copyreg.dispatch_table or (table is not None and t in table):
        return NotImplemented
    reduce_ex = getattr(obj, "__reduce_ex__", None)
    if reduce_ex is None:
        return NotImplemented
    rv = reduce_ex(pickler._protocol)
    if type(rv) is not tuple or len(rv) < 3:
        return rv
    state = rv[2]
    if type(state) is dict:
        if not _has_set(state.values()):
            return rv
        state = _canonical_dict(pickler, state)
    elif type(state) is tuple and len(state) == 2:
        parts = [
            _canonical_dict(pickler, p) if type(p) is dict and _has_set(p.values()) else p
            for p in state
        ]
        if parts[0] is state[0] and parts[1] is state[1]:
            return rv
        state = tuple(parts)
    else:
        return rv
    return (rv[0], rv[1], state, *rv[3:])


# ---------------------------------------------------------------------------------------
# State getters
# ---------------------------------------------------------------------------------------


def function_getstate(pickler: Pickler, func: types.FunctionType) -> dict[str, Any]:
    code = func.__code__
    pruned = pickler._pruned.get(id(func), ())
    # [Note: state keys] The keys start with "@" so that they are never interned: an
    # interned key would be the very object of a user string spelled the same (a function
    # named "closure"), and whether the pickler writes it or a memo reference would then
    # depend on string identity, which changes when a payload is reloaded and dumped again.
    state: dict[str, Any] = {}

    g = func.__globals__
    names = code_global_names(code)
    if names:
        gvals = {n: canonical(pickler, g[n]) for n in names if n in g and n != "__builtins__"}
        if gvals:
            state["@globals"] = gvals

    if func.__closure__:
        contents: dict[str, Any] = {}
        for name, cell in zip(code.co_freevars, func.__closure__):
            try:
                contents[name] = canonical(pickler, cell.cell_contents)
            except ValueError:  # an empty cell stays empty (reading it raises NameError)
                pass
        if contents:
            state["@closure"] = contents

    # Modules read as globals or from cells may be reached as ``pkg.sub.attr``; name the
    # imported submodules so the loading process imports them too (B20).
    mods = [v for v in (*state.get("@globals", {}).values(), *state.get("@closure", {}).values())
            if isinstance(v, types.ModuleType)]  # fmt: skip
    if mods:
        attrs = code_attribute_names(code)
        subs = [sub for m in mods for sub in find_submodules(m, attrs)]
        if subs:
            state["@submodules"] = subs

    if func.__dict__:
        d = {
            k: canonical(pickler, v)
            for k, v in func.__dict__.items()
            if ("__dict__", k) not in pruned
        }
        if d:
            state["@dict"] = d
    tp = getattr(func, "__type_params__", None)
    if tp and ("__type_params__",) not in pruned:
        state["@type_params"] = tp
    if func.__defaults__ is not None:
        state["@defaults"] = canonical(pickler, func.__defaults__)
    if func.__kwdefaults__ is not None:
        state["@kwdefaults"] = _canonical_dict(pickler, func.__kwdefaults__)
    state["@doc"] = None if ("__doc__",) in pruned else func.__doc__
    ann = func.__annotations__
    if ann:
        state["@annotations"] = {
            k: v for k, v in ann.items() if ("__annotations__", k) not in pruned
        }
    # FunctionType takes __qualname__ from co_qualname (3.11+); carry it only when it was
    # reassigned, e.g. by functools.wraps. Older Pythons always carry it.
    if func.__qualname__ != getattr(code, "co_qualname", None):
        state["@qualname"] = func.__qualname__
    state["@module"] = func.__module__
    return state


# __slotnames__ is copyreg's per-class cache, rebuilt on demand.
_CLASS_DICT_SKIP = frozenset(
    {"__dict__", "__weakref__", "__module__", "__qualname__", "__slotnames__"}
)
_ENUM_DICT_SKIP = frozenset(
    {
        "_generate_next_value_",
        "_member_names_",
        "_member_map_",
        "_member_type_",
        "_value2member_map_",
        "_unhashable_values_",
        "_new_member_",
        "_use_args_",
        "_value_repr_",
        "__new__",
    }
)


def class_getstate(pickler: Pickler, cls: type) -> tuple[dict[str, Any], list[type]]:
    clsdict = dict(cls.__dict__)
    slots = clsdict.get("__slots__", ())
    slots = (slots,) if isinstance(slots, str) else tuple(slots)
    registry: list[type] = []
    if "_abc_impl" in clsdict:
        registry = [r() for r in abc._get_dump(cls)[0]]  # type: ignore[attr-defined]
        registry = sorted((c for c in registry if c is not None), key=lambda c: c.__qualname__)
        del clsdict["_abc_impl"]
    skip = _CLASS_DICT_SKIP | set(slots)
    if isinstance(cls, enum.EnumMeta):
        skip |= _ENUM_DICT_SKIP | set(cls.__members__)
    attrs = {k: canonical(pickler, v) for k, v in clsdict.items() if k not in skip}
    attrs.pop("__slots__", None)  # slots were given at creation
    return attrs, registry


# ---------------------------------------------------------------------------------------
# Reducers
# ---------------------------------------------------------------------------------------


def _code_args(code: types.CodeType, consts: tuple[Any, ...]) -> tuple[Any, ...]:
    if sys.version_info >= (3, 11):
        return (
            code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount,
            code.co_nlocals, code.co_stacksize, code.co_flags, code.co_code, consts,
            code.co_names, code.co_varnames, code.co_filename, code.co_name,
            code.co_qualname, code.co_firstlineno, code.co_linetable,
            code.co_exceptiontable, code.co_freevars, code.co_cellvars,
        )  # fmt: skip
    return (
        code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount,
        code.co_nlocals, code.co_stacksize, code.co_flags, code.co_code, consts,
        code.co_names, code.co_varnames, code.co_filename, code.co_name,
        code.co_firstlineno, code.co_linetable, code.co_freevars, code.co_cellvars,
    )  # fmt: skip


_VERSION = tuple(sys.version_info[:2])


def code_reduce(pickler: Pickler, code: types.CodeType) -> tuple[Any, ...]:
    consts = tuple(canonical(pickler, c) for c in code.co_consts)
    return R._make_code, (_VERSION, _code_args(code, consts))


def cell_reduce(pickler: Pickler, cell: types.CellType) -> tuple[Any, ...]:
    # A cell that belongs to a function being pickled travels empty: the function's state
    # fills it after the function is memoized, which is what makes a recursive closure
    # terminate. A cell reached on its own carries its contents as its own state.
    if id(cell) in pickler._closure_cells:
        return R._make_cell, ()
    try:
        contents = cell.cell_contents
    except ValueError:
        return R._make_cell, ()
    return R._make_cell, (), canonical(pickler, contents), None, None, R._cell_setstate


def _globals_skeleton(pickler: Pickler, g: dict[str, Any]) -> dict[str, Any]:
    # One skeleton per distinct __globals__ per payload, so functions of one module share
    # one rebuilt dict (B17). It travels as a reduce argument and holds only what relative
    # imports need; each function's referenced names arrive as that function's state,
    # after the function is memoized, so a function that reads itself as a global
    # (recursion, a registry dict holding it) terminates.
    base = pickler._globals_skeletons.get(id(g))
    if base is None:
        base = {"__name__": g.get("__name__")}
        if g.get("__package__") is not None:
            base["__package__"] = g["__package__"]
        pickler._globals_skeletons[id(g)] = base
        pickler._keepalive.append(g)
    return base


def function_reduce(pickler: Pickler, func: types.FunctionType) -> Any:
    if lookup_by_reference(func):
        return NotImplemented  # the C pickler writes a GLOBAL opcode
    closure = func.__closure__
    if closure:
        for cell in closure:
            pickler._closure_cells[id(cell)] = cell
    base = _globals_skeleton(pickler, func.__globals__)
    code = func.__code__
    # The name travels only when it differs from co_name (wraps renames): a second copy
    # of an equal string would be memoized or not depending on string identity, which
    # differs between the dumping process and one that reloaded the function.
    name = None if func.__name__ == code.co_name else func.__name__
    return (
        R._make_function,
        (code, base, name, closure),
        function_getstate(pickler, func),
        None,
        None,
        R._function_setstate,
    )


def _class_type_kwargs(cls: type) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"__module__": cls.__module__}
    if "__slots__" in cls.__dict__:
        kwargs["__slots__"] = cls.__dict__["__slots__"]
    return kwargs


def class_reduce(pickler: Pickler, cls: type) -> Any:
    # Types of the interpreter itself (FunctionType is ``builtins.function``, which does
    # not resolve by name) exist everywhere: name them through the types module.
    builtin_name = _BUILTIN_TYPES.get(id(cls))
    if builtin_name is not None and getattr(types, builtin_name) is cls:
        return getattr, (types, builtin_name)
    if cls.__module__ == "builtins" or lookup_by_reference(cls):
        return NotImplemented
    tid = R.class_tracker_id(cls)
    if isinstance(cls, enum.EnumMeta):
        members = {name: m._value_ for name, m in cls.__members__.items()}
        return (
            R._make_skeleton_enum,
            (cls.__bases__, cls.__name__, cls.__qualname__, members, cls.__module__, tid),
            class_getstate(pickler, cls),
            None,
            None,
            R._class_setstate,
        )
    return (
        R._make_skeleton_class,
        (type(cls), cls.__name__, cls.__qualname__, cls.__bases__, _class_type_kwargs(cls), tid),
        class_getstate(pickler, cls),
        None,
        None,
        R._class_setstate,
    )


_BUILTIN_TYPES = {
    id(t): name
    for name, t in vars(types).items()
    if isinstance(t, type) and name.endswith("Type") and t.__module__ == "builtins"
}


def module_reduce(pickler: Pickler, module: types.ModuleType) -> Any:
    name = module.__name__
    if sys.modules.get(name) is module and not is_registered_by_value(name):
        return R._import_module, (name,)
    # A module that exists only here (made with types.ModuleType, or registered by
    # value) travels with its namespace.
    ns = {k: v for k, v in vars(module).items() if k != "__builtins__"}
    return R._make_dynamic_module, (name, ns)


def method_reduce(pickler: Pickler, method: types.MethodType) -> Any:
    # Always (function, receiver): reading __func__ and __self__ runs no user code, and a
    # hand-built MethodType whose name does not resolve on the receiver, or a property
    # named like the method, still comes back as the same bound method.
    return types.MethodType, (method.__func__, method.__self__)


def property_reduce(pickler: Pickler, prop: property) -> Any:
    return property, (prop.fget, prop.fset, prop.fdel, prop.__doc__)


def classmethod_reduce(pickler: Pickler, cm: Any) -> Any:
    return type(cm), (cm.__func__,)


def mappingproxy_reduce(pickler: Pickler, proxy: types.MappingProxyType[Any, Any]) -> Any:
    return types.MappingProxyType, (dict(proxy),)


def typevar_reduce(pickler: Pickler, tv: Any) -> Any:
    module = sys.modules.get(getattr(tv, "__module__", ""), None)
    if module is not None and getattr(module, tv.__name__, None) is tv:
        return NotImplemented
    return R._make_typevar, (
        tv.__name__, tv.__bound__, tv.__constraints__, tv.__covariant__, tv.__contravariant__
    )  # fmt: skip


_DATACLASS_SENTINELS = {
    id(getattr(dataclasses, n)): n
    for n in ("MISSING", "_HAS_DEFAULT_FACTORY", "_FIELD", "_FIELD_CLASSVAR", "_FIELD_INITVAR")
    if hasattr(dataclasses, n)
}


def dataclass_sentinel_reduce(pickler: Pickler, obj: Any) -> Any:
    name = _DATACLASS_SENTINELS.get(id(obj))
    if name is None:
        return NotImplemented
    return R._dataclass_sentinel, (name,)


def refuse_reduce(pickler: Pickler, obj: Any) -> Any:
    # Refuse up front with a message that says why; the C pickler's own
    # "cannot pickle 'generator' object" does not.
    from cadence.pickling._pickler import UnpicklableError

    kind = type(obj).__name__
    what = getattr(obj, "__qualname__", None) or kind
    raise UnpicklableError(
        f"cannot pickle {kind} object {what!r}: a {kind} holds a live, suspended frame "
        "that no pickler can rebuild; pickle the function that creates it (and its "
        "arguments) instead"
    )


def _sortedset_passthrough(pickler: Pickler, obj: Any) -> Any:
    return obj.__reduce__()


REDUCERS: dict[type, Any] = {
    types.FunctionType: function_reduce,
    types.CellType: cell_reduce,
    types.CodeType: code_reduce,
    types.ModuleType: module_reduce,
    types.MethodType: method_reduce,
    property: property_reduce,
    classmethod: classmethod_reduce,
    staticmethod: classmethod_reduce,
    types.MappingProxyType: mappingproxy_reduce,
    typing.TypeVar: typevar_reduce,
    _SortedSet: _sortedset_passthrough,
    types.GeneratorType: refuse_reduce,
    types.CoroutineType: refuse_reduce,
    types.AsyncGeneratorType: refuse_reduce,
    types.FrameType: refuse_reduce,
    types.TracebackType: refuse_reduce,
}
for _sentinel_name in set(_DATACLASS_SENTINELS.values()):
    REDUCERS[type(getattr(dataclasses, _sentinel_name))] = dataclass_sentinel_reduce
