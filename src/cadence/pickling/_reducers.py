"""Dispatch: which reducer handles an object, and the fallback for everything else.

``REDUCERS`` maps exact types to reducers (functions and code in ``_reduce_functions``,
class-body objects and typing objects in ``_reduce_classes``, built-in data in
``_reduce_builtins``). Classes of any metaclass go to ``class_reduce``. Any other object
goes to :func:`object_reduce`, which leaves it to the C pickler unless its state holds a
set (see [Note: deterministic containers]).
"""

from __future__ import annotations

import copyreg
import types
from typing import Any

from cadence.pickling._canonical import SortedSet, canonical_dict, has_set
from cadence.pickling._reduce_builtins import (
    BUILTIN_REDUCERS,
    SUBCLASS_REDUCERS,
    StorageRef,
    torch_reducers,
)
from cadence.pickling._reduce_classes import CLASS_REDUCERS, class_reduce
from cadence.pickling._reduce_functions import (
    cell_reduce,
    code_reduce,
    function_reduce,
    method_reduce,
    module_reduce,
)
from cadence.pickling._state import DumpState

# Everything not listed here is private to cadence.pickling.
__all__ = ["REDUCERS", "class_reduce", "object_reduce", "register_optional_reducers"]


def _own_reduce(state: DumpState, obj: Any) -> Any:
    # cadence's own stand-ins (sorted sets, tensor storages) know how to reduce.
    return obj.__reduce__()


REDUCERS: dict[type, Any] = {
    types.FunctionType: function_reduce,
    types.CellType: cell_reduce,
    types.CodeType: code_reduce,
    types.ModuleType: module_reduce,
    types.MethodType: method_reduce,
    SortedSet: _own_reduce,
    StorageRef: _own_reduce,
    **CLASS_REDUCERS,
    **BUILTIN_REDUCERS,
}

_torch_done = False


def register_optional_reducers() -> None:
    """Add the torch reducers once torch has been imported (by the caller, never here).

    Called for every new Pickler: until torch shows up it costs one dict lookup.
    """
    global _torch_done
    if not _torch_done:
        extra = torch_reducers()
        if extra:
            REDUCERS.update(extra)
            _torch_done = True


_PLAIN_TYPES: dict[type, bool] = {}


def _is_plain_type(t: type) -> bool:
    return (
        t.__reduce_ex__ is object.__reduce_ex__
        and t.__reduce__ is object.__reduce__
        and getattr(t, "__getstate__", None) is getattr(object, "__getstate__", None)
        and not any("__slots__" in vars(k) for k in t.__mro__)
        and t not in copyreg.dispatch_table
    )


def object_reduce(state: DumpState, obj: Any, table: Any) -> Any:
    """Any other object: its own reduce, with sets in its state made deterministic.

    ``table`` is the pickler's ``dispatch_table`` (or None). Objects with an entry there
    or in ``copyreg.dispatch_table`` are left to the C pickler, so those tables keep their
    precedence. The state is copied only when it holds a set.
    """
    t = type(obj)
    plain = _PLAIN_TYPES.get(t)
    if plain is None:
        for base, reducer in SUBCLASS_REDUCERS.items():
            if issubclass(t, base):
                REDUCERS[t] = reducer  # found by exact type from now on
                return reducer(state, obj)
        if len(_PLAIN_TYPES) > 4096:  # bound the cache; dynamic classes come and go
            _PLAIN_TYPES.clear()
        plain = _PLAIN_TYPES[t] = _is_plain_type(t)
    if plain:
        # The common instance: default reduce, state is its __dict__. Leave it to the C
        # pickler unless that dict holds a set.
        d = getattr(obj, "__dict__", None)
        if d is None or not has_set(d.values()):
            return NotImplemented
    if t in copyreg.dispatch_table or (table is not None and t in table):
        return NotImplemented
    reduce_ex = getattr(obj, "__reduce_ex__", None)
    if reduce_ex is None:
        return NotImplemented
    rv = reduce_ex(state.protocol)
    if type(rv) is not tuple or len(rv) < 3:
        return rv
    st = rv[2]
    if type(st) is dict:
        if not has_set(st.values()):
            return rv
        st = canonical_dict(state, st)
    elif type(st) is tuple and len(st) == 2:
        parts = [
            canonical_dict(state, p) if type(p) is dict and has_set(p.values()) else p for p in st
        ]
        if parts[0] is st[0] and parts[1] is st[1]:
            return rv
        st = tuple(parts)
    else:
        return rv
    return (rv[0], rv[1], st, *rv[3:])
