"""Dispatch: which reducer handles an object, and the fallback for everything else.

``REDUCERS`` maps exact types to reducers (functions and code in ``_reduce_functions``,
class-body objects and typing objects in ``_reduce_classes``, built-in data in
``_reduce_builtins``). Classes of any metaclass go to ``class_reduce``. Any other object
goes to :func:`object_reduce`, which leaves it to the C pickler unless its state holds a
set (see [Note: deterministic containers]). :func:`dispatch` makes that choice once per
type.
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
__all__ = ["DISPATCH", "REDUCERS", "dispatch", "register_optional_reducers"]


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
            DISPATCH.clear()
            _torch_done = True


# [Note: dispatch cache] ``reducer_override`` runs for every object the C pickler does
# not handle itself (everything but None, bools, ints, floats, str, bytes and the exact
# built-in containers), so its per-object cost is the pickler's cost on instance-heavy
# payloads. The decision "which reducer" depends on the type only, so it is made once per
# type and cached: a type listed in REDUCERS, any class (a type of type), a subclass of a
# type whose reducer serves subclasses, a "plain" type (default reduce, no slots, no
# copyreg entry) whose instances only need their __dict__ checked for sets, or anything
# else. The cache is cleared when it grows past a bound (dynamic classes come and go).
DISPATCH: dict[type, Any] = {}
_DISPATCH_LIMIT = 4096


def dispatch(t: type) -> Any:
    """The reducer for objects of exact type ``t`` (see [Note: dispatch cache])."""
    reducer = REDUCERS.get(t)
    if reducer is None:
        if issubclass(t, type):
            reducer = class_reduce
        else:
            for base, sub_reducer in SUBCLASS_REDUCERS.items():
                if issubclass(t, base):
                    reducer = sub_reducer
                    break
            else:
                reducer = _plain_reduce if _is_plain_type(t) else object_reduce
    if len(DISPATCH) >= _DISPATCH_LIMIT:
        DISPATCH.clear()
    DISPATCH[t] = reducer
    return reducer


def _is_plain_type(t: type) -> bool:
    # Read from a class these are the plain functions, which mypy types as bound
    # methods of different signatures; the identity test is the point.
    return (
        t.__reduce_ex__ is object.__reduce_ex__  # type: ignore[comparison-overlap]  # identity of the plain functions
        and t.__reduce__ is object.__reduce__  # type: ignore[comparison-overlap]  # identity of the plain functions
        and getattr(t, "__getstate__", None) is getattr(object, "__getstate__", None)
        and not any("__slots__" in vars(k) for k in t.__mro__)
        and t not in copyreg.dispatch_table
    )


_SET_TYPES = (set, frozenset)


def _plain_reduce(state: DumpState, obj: Any) -> Any:
    # The common instance: default reduce, state is its __dict__. Left to the C pickler
    # unless that dict holds a set. (A plain loop: any() over a generator costs a frame.)
    d = getattr(obj, "__dict__", None)
    if d is not None:
        for v in d.values():
            if type(v) in _SET_TYPES:
                return object_reduce(state, obj)
    return NotImplemented


def object_reduce(state: DumpState, obj: Any) -> Any:
    """Any other object: its own reduce, with sets in its state made deterministic.

    Objects with an entry in the pickler's ``dispatch_table`` or in
    ``copyreg.dispatch_table`` are left to the C pickler, so those tables keep their
    precedence. The state is copied only when it holds a set.
    """
    t = type(obj)
    table = state.table
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
