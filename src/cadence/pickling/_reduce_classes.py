"""Reducers for classes, the descriptors a class body holds, and typing objects.

A class goes by reference when its name resolves to it (see ``_lookup``); otherwise by
value: a skeleton made with the class's own metaclass, then its attributes as state,
with a tracker id so that loading it twice gives one class (see [Note: tracker ids]).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import functools
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any

from cadence.pickling import _reconstructors, _reconstructors_data
from cadence.pickling._canonical import canonical, name
from cadence.pickling._lookup import is_registered_by_value, lookup_by_reference
from cadence.pickling._state import DumpState
from cadence.pickling._tracker import tracker_id

# Everything not listed here is private to cadence.pickling.
__all__ = ["CLASS_REDUCERS", "class_reduce"]

# __slotnames__ is copyreg's per-class cache, rebuilt on demand. __dict__ and __weakref__
# are getset descriptors type() makes for the class itself; the abc caches are rebuilt on
# the first isinstance check (the registry travels separately); __module__, __slots__ and
# __orig_bases__ travel with the skeleton; __annotate_func__ (3.14) is a closure over the
# class dict that Python makes again on the first read of __annotations__.
_CLASS_DICT_SKIP = frozenset(
    {"__dict__", "__weakref__", "__module__", "__qualname__", "__slotnames__", "_abc_impl",
     "__orig_bases__", "__annotate_func__"}
)  # fmt: skip
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


def class_getstate(state: DumpState, cls: type) -> tuple[dict[str, Any], list[type]]:
    clsdict = cls.__dict__
    slots = clsdict.get("__slots__", ())
    slots = (slots,) if isinstance(slots, str) else tuple(slots)
    registry: list[type] = []
    if "_abc_impl" in clsdict:
        # The registry (``register()``-ed virtual subclasses) is part of the class; the
        # caches of past isinstance checks are not (and would drag unrelated classes).
        registry = [r() for r in abc._get_dump(cls)[0]]  # type: ignore[attr-defined]  # abc's private helper is not in typeshed
        registry = sorted((c for c in registry if c is not None), key=_class_sort_key)
    skip = _CLASS_DICT_SKIP.union(slots) if slots else _CLASS_DICT_SKIP
    if isinstance(cls, enum.EnumMeta):
        skip = skip | _ENUM_DICT_SKIP | set(cls.__members__)
    # Names through name() (see [Note: names in the payload]), sorted: a loaded
    # class's dict has another order than the original's (the skeleton gets __doc__ at
    # creation, before the other attributes), and the order is written into the payload.
    attrs = {name(k): canonical(state, clsdict[k]) for k in sorted(clsdict) if k not in skip}
    attrs.pop("__slots__", None)  # slots were given at creation
    return attrs, registry


def _class_sort_key(cls: type) -> tuple[str, str]:
    return (cls.__module__, cls.__qualname__)


def _class_type_kwargs(state: DumpState, cls: type) -> dict[str, Any]:
    module = cls.__module__
    kwargs: dict[str, Any] = {"__module__": name(module) if type(module) is str else module}
    if "__slots__" in cls.__dict__:
        kwargs["__slots__"] = cls.__dict__["__slots__"]
    if "__orig_bases__" in cls.__dict__:
        # typing.Generic subclasses: the parametrised bases (``Base[T]``) carry the type
        # parameters; __bases__ alone would lose them.
        kwargs["__orig_bases__"] = cls.__dict__["__orig_bases__"]
    return kwargs


_BUILTIN_TYPES = {
    id(t): name
    for name, t in vars(types).items()
    if isinstance(t, type) and name.endswith("Type") and t.__module__ == "builtins"
}


def class_reduce(state: DumpState, cls: type) -> Any:
    # Types of the interpreter itself (FunctionType is ``builtins.function``, which does
    # not resolve by name) exist everywhere: name them through the types module.
    builtin_name = _BUILTIN_TYPES.get(id(cls))
    if builtin_name is not None and getattr(types, builtin_name) is cls:
        return getattr, (types, builtin_name)
    if cls.__module__ == "builtins" or lookup_by_reference(cls):
        return NotImplemented
    tid = tracker_id(cls)
    if isinstance(cls, enum.EnumMeta):
        by_name: Mapping[str, enum.Enum] = cls.__members__
        members = {name(k): m._value_ for k, m in by_name.items()}
        return (
            _reconstructors._make_skeleton_enum,
            (
                cls.__bases__,
                name(cls.__name__),
                name(cls.__qualname__),
                members,
                name(cls.__module__),
                tid,
            ),
            class_getstate(state, cls),
            None,
            None,
            _reconstructors._class_setstate,
        )
    return (
        _reconstructors._make_skeleton_class,
        (
            type(cls),
            name(cls.__name__),
            name(cls.__qualname__),
            cls.__bases__,
            _class_type_kwargs(state, cls),
            tid,
        ),
        class_getstate(state, cls),
        None,
        None,
        _reconstructors._class_setstate,
    )


# ---------------------------------------------------------------------------------------
# What a class body holds
# ---------------------------------------------------------------------------------------


def _property_reduce(state: DumpState, prop: property) -> Any:
    return type(prop), (prop.fget, prop.fset, prop.fdel, prop.__doc__)


def _wrapper_reduce(state: DumpState, cm: Any) -> Any:
    # classmethod, staticmethod and abc's deprecated abstractclassmethod /
    # abstractstaticmethod: rebuilt from the function they wrap.
    return type(cm), (cm.__func__,)


def _cached_property_reduce(state: DumpState, prop: functools.cached_property[Any]) -> Any:
    # Its default reduce carries its lock (3.11 and older), which does not pickle.
    return _reconstructors_data._make_cached_property, (prop.func, prop.attrname, prop.__doc__)


def _class_dict_descriptor_reduce(state: DumpState, desc: Any) -> Any:
    # getset descriptors (``float.real``) and classmethod descriptors
    # (``float.__dict__["fromhex"]``) have no reduce of their own, and a member
    # descriptor's own reduce, ``getattr(owner, name)``, gives the attribute's *value*
    # when the owner is a metaclass (``type.__basicsize__``): name them all through the
    # dict of the class that owns them.
    owner, name = desc.__objclass__, desc.__name__
    if owner.__dict__.get(name) is not desc:
        return NotImplemented
    return _reconstructors_data._class_dict_entry, (owner, name)


_DATACLASS_SENTINELS = {
    id(getattr(dataclasses, n)): n
    for n in ("MISSING", "_HAS_DEFAULT_FACTORY", "_FIELD", "_FIELD_CLASSVAR", "_FIELD_INITVAR")
    if hasattr(dataclasses, n)
}


def _dataclass_sentinel_reduce(state: DumpState, obj: Any) -> Any:
    sentinel = _DATACLASS_SENTINELS.get(id(obj))
    if sentinel is None:
        return NotImplemented
    return _reconstructors._dataclass_sentinel, (sentinel,)


def _mappingproxy_reduce(state: DumpState, proxy: types.MappingProxyType[Any, Any]) -> Any:
    return types.MappingProxyType, (dict(proxy),)


# ---------------------------------------------------------------------------------------
# Typing objects (tracked like classes)
# ---------------------------------------------------------------------------------------


def _by_name(obj: Any) -> bool:
    """A TypeVar-like object that its module publishes under its name: by reference.

    ``__main__`` never counts: the loading process has a ``__main__`` of its own.
    """
    module_name = getattr(obj, "__module__", None)
    if not isinstance(module_name, str) or module_name == "__main__":
        return False
    module = sys.modules.get(module_name)
    if module is None or is_registered_by_value(module_name):
        return False
    try:
        return getattr(module, obj.__name__, None) is obj
    except Exception:
        return False


def _typevar_reduce(state: DumpState, tv: Any) -> Any:
    if _by_name(tv):
        return NotImplemented
    return _reconstructors._make_typevar, (
        name(tv.__name__),
        tv.__bound__,
        tv.__constraints__,
        tv.__covariant__,
        tv.__contravariant__,
        tracker_id(tv),
    )


def _paramspec_reduce(state: DumpState, ps: Any) -> Any:
    if _by_name(ps):
        return NotImplemented
    options = {"bound": ps.__bound__, "covariant": ps.__covariant__,
               "contravariant": ps.__contravariant__}  # fmt: skip
    return _reconstructors._make_typing_param, (
        "ParamSpec",
        name(ps.__name__),
        options,
        tracker_id(ps),
    )


def _typevartuple_reduce(state: DumpState, tvt: Any) -> Any:
    if _by_name(tvt):
        return NotImplemented
    return _reconstructors._make_typing_param, (
        "TypeVarTuple",
        name(tvt.__name__),
        {},
        tracker_id(tvt),
    )


def _newtype_reduce(state: DumpState, nt: Any) -> Any:
    if _by_name(nt):
        return NotImplemented
    return _reconstructors._make_newtype, (
        name(nt.__name__),
        nt.__supertype__,
        name(nt.__module__),
        tracker_id(nt),
    )


CLASS_REDUCERS: dict[type, Any] = {
    property: _property_reduce,
    abc.abstractproperty: _property_reduce,
    classmethod: _wrapper_reduce,
    staticmethod: _wrapper_reduce,
    abc.abstractclassmethod: _wrapper_reduce,
    abc.abstractstaticmethod: _wrapper_reduce,
    functools.cached_property: _cached_property_reduce,
    types.GetSetDescriptorType: _class_dict_descriptor_reduce,
    types.ClassMethodDescriptorType: _class_dict_descriptor_reduce,
    types.MemberDescriptorType: _class_dict_descriptor_reduce,
    types.MappingProxyType: _mappingproxy_reduce,
    typing.TypeVar: _typevar_reduce,
    typing.ParamSpec: _paramspec_reduce,
    typing.NewType: _newtype_reduce,  # a class since 3.10
}
if hasattr(typing, "TypeVarTuple"):  # 3.11+
    CLASS_REDUCERS[typing.TypeVarTuple] = _typevartuple_reduce
for _sentinel_name in set(_DATACLASS_SENTINELS.values()):
    CLASS_REDUCERS[type(getattr(dataclasses, _sentinel_name))] = _dataclass_sentinel_reduce
