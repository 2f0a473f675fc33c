"""Tracker ids: a class or typing object pickled by value comes back as *one* object.

[Note: tracker ids] A class defined in ``__main__`` or in a function, sent to a worker
twice (two payloads, or two loads of one payload), must come back as the *same* class
there, or ``isinstance`` breaks between the results of two calls; and an instance the
worker sends back must be an instance of the original class in the driver. So each
class (and each ``TypeVar``, ``ParamSpec``, ``TypeVarTuple`` and ``NewType``) pickled
by value carries a tracker id, and the loader keeps a weak map id -> object: the first
load builds the object, later loads hand back the same one, and an object that was
loaded keeps the id it came with, so sending it back maps onto the original.

cloudpickle draws the id from ``uuid4``, which makes every payload holding a class
differ from run to run. cadence derives it instead, so the same program gives the same
bytes: ``module:qualname#ordinal.fingerprint``.

* The *ordinal* counts the distinct objects of that ``module:qualname`` this process
  has tracked, so a class redefined in a notebook gets a new id (old instances on a
  worker stay instances of the old class, as with cloudpickle).
* The *fingerprint* hashes the definition (names, bases, bytecode, constants, line
  numbers). Without it, two drivers that each define a ``__main__.Config`` and share a
  long-lived worker would both send ``__main__:Config#0``, and the worker would hand the
  second driver's instances the first driver's class. With it, only identical
  definitions share an id, where sharing is harmless.

The fingerprint reads code and literal constants only (never ``repr`` of arbitrary
objects, which may embed addresses or hash order), so it is the same in every process
and under every PYTHONHASHSEED.
"""

from __future__ import annotations

import hashlib
import threading
import types
import weakref
from typing import Any

# Everything not listed here is private to cadence.pickling.
__all__ = ["complete", "is_complete", "lookup", "track", "tracker_id"]

_BY_ID: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_ID_OF: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
# Classes whose attributes are in place: the original classes and fully loaded copies.
# A class handed back by the tracker is never given state again (that would swap its
# methods for copies).
_COMPLETE: weakref.WeakSet[Any] = weakref.WeakSet()
_ORDINALS: dict[str, int] = {}
# Two threads dumping (or loading) the same new class at once must agree on one id.
_LOCK = threading.Lock()
_LITERALS = (str, bytes, int, float, complex, bool, type(None), type(Ellipsis))


def _fp_code(code: types.CodeType, out: list[str]) -> None:
    out.append(code.co_code.hex())
    out.append(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)))
    out.append(repr((code.co_argcount, code.co_kwonlyargcount, code.co_firstlineno)))
    for const in code.co_consts:
        _fp_value(const, out)


def _fp_value(value: Any, out: list[str]) -> None:
    t = type(value)
    if t in _LITERALS:
        out.append(repr(value))
    elif t is types.FunctionType:
        _fp_code(value.__code__, out)
    elif t is types.CodeType:
        _fp_code(value, out)
    elif isinstance(value, (classmethod, staticmethod)):
        out.append(t.__qualname__)
        _fp_value(value.__func__, out)
    elif isinstance(value, property):
        out.append(t.__qualname__)
        for f in (value.fget, value.fset, value.fdel):
            _fp_value(f, out)
    elif t is tuple:
        out.append("(")
        for v in value:
            _fp_value(v, out)
        out.append(")")
    elif t is frozenset or t is set:
        out.append("{" + ",".join(sorted(repr(v) for v in value if type(v) in _LITERALS)) + "}")
    elif isinstance(value, type):
        out.append(f"{value.__module__}.{value.__qualname__}")
    else:
        out.append(t.__qualname__)


def _fingerprint(obj: Any) -> str:
    out: list[str] = [type(obj).__qualname__]
    if isinstance(obj, type):
        out.extend(f"{b.__module__}.{b.__qualname__}" for b in obj.__bases__)
        attrs = vars(obj)
        for name in sorted(attrs):
            out.append(name)
            _fp_value(attrs[name], out)
    else:  # TypeVar, ParamSpec, TypeVarTuple, NewType
        for attr in ("__bound__", "__constraints__", "__covariant__", "__contravariant__",
                     "__supertype__"):  # fmt: skip
            _fp_value(getattr(obj, attr, None), out)
    return hashlib.sha256("\x00".join(out).encode("utf-8", "replace")).hexdigest()[:12]


def tracker_id(obj: Any) -> str:
    """The tracker id of a class or typing object pickled by value (made on first use)."""
    tid = _ID_OF.get(obj)
    if tid is not None:
        return tid
    with _LOCK:
        tid = _ID_OF.get(obj)
        if tid is not None:
            return tid
        name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "?")
        key = f"{getattr(obj, '__module__', None)}:{name}"
        fp = _fingerprint(obj)
        n = _ORDINALS.get(key, 0)
        while f"{key}#{n}.{fp}" in _BY_ID:
            n += 1
        _ORDINALS[key] = n + 1
        tid = f"{key}#{n}.{fp}"
        _ID_OF[obj] = tid
        _BY_ID[tid] = obj
        if isinstance(obj, type):
            _COMPLETE.add(obj)
    return tid


def lookup(tid: str) -> Any:
    """The live object tracked under ``tid``, or None."""
    return _BY_ID.get(tid)


def track(tid: str, obj: Any) -> Any:
    """Track a freshly loaded ``obj`` under ``tid``; return the object to use."""
    with _LOCK:
        existing = _BY_ID.get(tid)
        if existing is not None:
            return existing
        _BY_ID[tid] = obj
        _ID_OF[obj] = tid
        return obj


def is_complete(cls: Any) -> bool:
    return cls in _COMPLETE


def complete(cls: Any) -> None:
    _COMPLETE.add(cls)
