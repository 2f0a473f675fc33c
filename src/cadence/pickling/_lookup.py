"""Registry, importability lookup and code introspection.

These are the questions the reducers ask before they decide how an object travels:

* **Registry.** Which modules the user asked to ship by value.
* **Importability lookup.** Can this function or class be pickled *by reference*, that
  is, will importing ``__module__`` and walking ``__qualname__`` in the loading process
  give back this very object? Only identity answers that; markers such as ``<locals>``
  are shortcuts for the negative answer, never for the positive one.
* **Code introspection.** Which global names a code object (and every code object nested
  in its constants) reads, and which imported submodules it reaches by attribute.
"""

from __future__ import annotations

import dis
import sys
import types
import weakref
from typing import Any

# Everything not listed here is private to cadence.pickling.
__all__ = [
    "code_attribute_names",
    "code_global_names",
    "find_submodules",
    "is_registered_by_value",
    "list_registry_pickle_by_value",
    "lookup_by_reference",
    "register_pickle_by_value",
    "unregister_pickle_by_value",
]

# ---------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------
# Module names whose functions and classes travel by value even though they import fine
# here. A registered package covers its submodules (prefix match on dotted parents), as in
# cloudpickle, so registering ``mypkg`` also ships ``mypkg.sub.fn`` by value.

_PICKLE_BY_VALUE_MODULES: set[str] = set()


def register_pickle_by_value(module: types.ModuleType) -> None:
    """Ship the functions and classes of ``module`` (and its submodules) by value.

    Use it for code that exists where you pickle but not where you load, for example a
    module on the driver's ``sys.path`` only.
    """
    if not isinstance(module, types.ModuleType):
        raise ValueError(f"register_pickle_by_value expects a module, got {module!r}")
    if sys.modules.get(module.__name__) is not module:
        raise ValueError(
            f"{module!r} is not in sys.modules under its own name; register a module that "
            "you reached with an `import` statement"
        )
    _PICKLE_BY_VALUE_MODULES.add(module.__name__)


def unregister_pickle_by_value(module: types.ModuleType) -> None:
    """Undo :func:`register_pickle_by_value`."""
    if not isinstance(module, types.ModuleType):
        raise ValueError(f"unregister_pickle_by_value expects a module, got {module!r}")
    if module.__name__ not in _PICKLE_BY_VALUE_MODULES:
        raise ValueError(f"{module!r} is not registered for pickling by value")
    _PICKLE_BY_VALUE_MODULES.discard(module.__name__)


def list_registry_pickle_by_value() -> set[str]:
    """The names of the modules registered for pickling by value (a copy)."""
    return set(_PICKLE_BY_VALUE_MODULES)


def is_registered_by_value(module_name: str) -> bool:
    if not _PICKLE_BY_VALUE_MODULES:  # the common case costs one truth test
        return False
    name = module_name
    while True:
        if name in _PICKLE_BY_VALUE_MODULES:
            return True
        head, dot, _ = name.rpartition(".")
        if not dot:
            return False
        name = head


# ---------------------------------------------------------------------------------------
# Importability lookup
# ---------------------------------------------------------------------------------------


def lookup_by_reference(obj: Any) -> bool:
    """True when ``obj`` may be pickled by name: the name walk lands on ``obj`` itself.

    A module-level ``functools.wraps`` wrapper claims the wrappee's ``__module__`` and
    ``__qualname__`` but is a different object, so it fails this test and goes by value;
    so do lambdas, ``<locals>`` definitions, ``__main__`` code, functions whose
    ``__module__`` is ``None`` or not a string, and modules registered by value.
    """
    module_name = getattr(obj, "__module__", None)
    if type(module_name) is not str or module_name == "__main__":
        return False
    qualname = getattr(obj, "__qualname__", None)
    if type(qualname) is not str or "<locals>" in qualname or "<lambda>" in qualname:
        return False
    module = sys.modules.get(module_name)
    if module is None or is_registered_by_value(module_name):
        return False
    found: Any = module
    try:
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:  # a raising module __getattr__ means "not resolvable", not a crash
        return False
    return found is obj


# ---------------------------------------------------------------------------------------
# Code introspection
# ---------------------------------------------------------------------------------------
# Both walks are cached per code object: a payload with a thousand closures from one
# factory shares one code object. The cache is keyed by id with a weak reference to check
# the id was not reused, and it is cleared wholesale when it grows past a bound, so
# dynamically created code does not accumulate.

_CACHE_LIMIT = 4096
_global_names_cache: dict[int, tuple[weakref.ref[types.CodeType], tuple[str, ...]]] = {}
_attr_names_cache: dict[int, tuple[weakref.ref[types.CodeType], frozenset[str]]] = {}

# [Note: scanning bytecode] The global names are read straight from ``co_code`` (the
# unspecialized bytecode): two bytes per unit, EXTENDED_ARG units prefixing the argument
# of the next one, and, from 3.11, LOAD_GLOBAL's argument holding the name index shifted
# left by one (the low bit says whether to push NULL). dis.get_instructions gives the
# same answer but builds an object per instruction with its disassembly text: seconds for
# a function with tens of thousands of globals, where this loop takes milliseconds. A
# test checks both agree on every code object of several stdlib modules.
_LOAD_GLOBAL = dis.opmap["LOAD_GLOBAL"]
_OTHER_GLOBAL_OPS = frozenset({dis.opmap["STORE_GLOBAL"], dis.opmap["DELETE_GLOBAL"]})
_EXTENDED_ARG = dis.EXTENDED_ARG
_LOAD_GLOBAL_SHIFT = 1 if sys.version_info >= (3, 11) else 0


def _global_name_indices(code: types.CodeType) -> list[int]:
    co = code.co_code
    out: list[int] = []
    ext = 0
    for i in range(0, len(co), 2):
        op = co[i]
        if op == _EXTENDED_ARG:
            ext = (ext | co[i + 1]) << 8
            continue
        arg = ext | co[i + 1]
        ext = 0
        if op == _LOAD_GLOBAL:
            out.append(arg >> _LOAD_GLOBAL_SHIFT)
        elif op in _OTHER_GLOBAL_OPS:
            out.append(arg)
    return out


def _nested_codes(code: types.CodeType) -> list[types.CodeType]:
    out = [code]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out.extend(_nested_codes(const))
    return out


def code_global_names(code: types.CodeType) -> tuple[str, ...]:
    """Global names read, written or deleted by ``code`` and its nested code objects.

    A tuple in first-seen order, never a set: the order of the rebuilt globals dict
    goes into the payload, and set order would change with ``PYTHONHASHSEED``.
    """
    hit = _global_names_cache.get(id(code))
    if hit is not None and hit[0]() is code:
        return hit[1]
    seen: dict[str, None] = {}
    for sub in _nested_codes(code):
        co_names = sub.co_names
        for index in _global_name_indices(sub):
            seen.setdefault(co_names[index], None)
    names = tuple(seen)
    if len(_global_names_cache) > _CACHE_LIMIT:
        _global_names_cache.clear()
    _global_names_cache[id(code)] = (weakref.ref(code), names)
    return names


def code_attribute_names(code: types.CodeType) -> frozenset[str]:
    """Every name in ``co_names`` of ``code`` and its nested code (globals and attributes)."""
    hit = _attr_names_cache.get(id(code))
    if hit is not None and hit[0]() is code:
        return hit[1]
    names = frozenset(n for sub in _nested_codes(code) for n in sub.co_names)
    if len(_attr_names_cache) > _CACHE_LIMIT:
        _attr_names_cache.clear()
    _attr_names_cache[id(code)] = (weakref.ref(code), names)
    return names


def find_submodules(module: types.ModuleType, names: frozenset[str]) -> list[types.ModuleType]:
    """Imported submodules of ``module`` that code reaches as ``module.a.b``.

    ``import xml.etree.ElementTree`` binds only ``xml``; a fresh interpreter that imports
    ``xml`` alone has no ``xml.etree``. So the payload also names each submodule whose
    every dotted part the code mentions. Built from the code's names rather than by
    scanning ``sys.modules``, which holds thousands of entries once torch is imported.
    """
    found: list[types.ModuleType] = []
    stack = [module.__name__]
    while stack:
        prefix = stack.pop()
        for name in sorted(names):  # sorted: the submodule list is part of the payload
            sub = sys.modules.get(f"{prefix}.{name}")
            if isinstance(sub, types.ModuleType) and sub not in found:
                found.append(sub)
                stack.append(sub.__name__)
    return found
