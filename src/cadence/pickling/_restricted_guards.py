"""The opcodes a restricted load runs differently from the standard unpickler.

[Note: why restricted loads run the pure-Python unpickler]
Resolving only allowed globals is not enough: the opcodes that change an object (BUILD
through ``__setstate__``, ``__dict__`` or setattr; APPEND, APPENDS, SETITEM, SETITEMS and
ADDITEMS through ``append``, ``extend``, ``__setitem__`` and ``add``) work on whatever is
on the stack. Given an allowed class, function or module-level object, they change it
for the whole process (BUILD onto ``Config`` sets class attributes, onto a function its
``__defaults__``), or call a class-level method named ``extend``. The C unpickler runs
these opcodes in C, with no method to override; ``pickle._Unpickler``, the pure-Python
unpickler the standard library keeps as its reference implementation, dispatches every
opcode through its ``dispatch`` table. A restricted load runs it with a copy of that
table in which these opcodes first refuse a target the payload did not create: one a
global named, or any class, module or function. The cost is speed (a few times slower
on many small objects; bulk bytes are read the same way), which a load of untrusted
data can afford.

[Note: reading what a length prefix claims, in chunks]
A length prefix (BINBYTES8, BINUNICODE8, BYTEARRAY8, FRAME) is eight bytes of the
payload. Reading what it claims in one call lets a few bytes ask for a terabyte:
``bytearray(n)`` before the read (BYTEARRAY8 in both unpicklers), or a file's ``read(n)``,
which allocates ``n`` up front. Here every read of more than a chunk goes a chunk at a
time, so the memory used follows the bytes that are really there, and a payload that
ends early raises `MalformedPayloadError`.
"""

from __future__ import annotations

import enum
import pickle
import struct
import sys
import types
from typing import Any, NoReturn

from cadence.pickling._errors import ForbiddenGlobalError, MalformedPayloadError

# Everything not listed here is private to cadence.pickling.
__all__ = ["ChunkedReader", "guarded_dispatch"]

_CHUNK = 1 << 20

# Objects every part of the process shares by construction: a payload never creates
# one (no allowed reconstructor builds classes, functions or modules; calling an enum
# class returns its existing member).
_SHARED_KINDS: tuple[tuple[type | tuple[type, ...], str], ...] = (
    (type, "a class"),
    (enum.Enum, "an enum member"),
    (types.ModuleType, "a module"),
    ((types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.CodeType),
     "a function"),
    ((types.MethodDescriptorType, types.WrapperDescriptorType, types.MethodWrapperType,
      types.ClassMethodDescriptorType, types.GetSetDescriptorType,
      types.MemberDescriptorType, staticmethod, classmethod, property), "a descriptor"),
)  # fmt: skip


def _truncated(wanted: int, got: int) -> MalformedPayloadError:
    return MalformedPayloadError(
        f"pickle data was truncated: an opcode needs {wanted} more bytes and the payload "
        f"holds {got}; the payload was cut short or its length prefix is forged"
    )


class ChunkedReader:
    """``read`` and ``readline`` of a binary file, reading long lengths a chunk at a time.

    See [Note: reading what a length prefix claims, in chunks]. Reads exactly what is
    asked for, so a file holding several pickles is left just after the one loaded.
    """

    def __init__(self, file: Any) -> None:
        self._read = file.read
        self.readline = file.readline

    def read(self, n: int) -> bytes:
        data: bytes
        if n <= _CHUNK:
            data = self._read(n)
        else:
            parts: list[bytes] = []
            left = n
            while left:
                part = self._read(min(left, _CHUNK))
                if not part:
                    break
                parts.append(part)
                left -= len(part)
            data = b"".join(parts)
        # One byte missing at an opcode boundary is the end of the input: the unpickler
        # reports it as EOFError("Ran out of input"), as the standard one does.
        if len(data) < n and (data or n > 1):
            raise _truncated(n, len(data))
        return data


def _shared_kind(obj: Any) -> str | None:
    for kinds, name in _SHARED_KINDS:
        if isinstance(obj, kinds):
            return name
    return None


def _check_target(u: Any, obj: Any, opcode: str) -> None:
    """Refuse changing ``obj`` unless the payload created it."""
    known = u._globals.get(id(obj))
    named = known is not None and known[0] is obj
    kind = _shared_kind(obj)
    if kind is None and not named:
        return
    if named:
        name = known[1]
        where = f"the global {name!r}"
        kind = kind or f"a {type(obj).__qualname__} that a module holds"
    else:
        name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"
        where = repr(name)
    raise ForbiddenGlobalError(
        f"refused {opcode} on {where}: it is {kind}, which the whole process shares, and "
        "a restricted load changes only the objects its payload created. No pickler "
        "writes this for data, so the payload was made by hand; load such payloads only "
        "from producers you trust (loads_signed)",
        name,
    )


def _load_build(u: Any) -> None:
    stack = u.stack
    state = stack.pop()
    inst = stack[-1]
    _check_target(u, inst, "BUILD")
    setstate = getattr(inst, "__setstate__", None)
    if setstate is not None:
        setstate(state)  # the allowed class's own code, as documented
        return
    slotstate = None
    if isinstance(state, tuple) and len(state) == 2:
        state, slotstate = state
    if state:
        inst_dict = inst.__dict__
        for k, v in state.items():
            inst_dict[sys.intern(k) if type(k) is str else k] = v
    if slotstate:
        for k, v in slotstate.items():
            # Slots are named by identifiers; a dunder here (``__dict__``, ``__class__``)
            # swaps the object's namespace or type, e.g. for a global dict that the next
            # BUILD then writes into.
            if type(k) is not str or (k.startswith("__") and k.endswith("__")):
                raise ForbiddenGlobalError(
                    f"refused BUILD setting {k!r} on a {type(inst).__qualname__}: a "
                    "pickled slot state names slots, never a special attribute, so the "
                    "payload was made by hand; load it only from a producer you trust",
                    f"{type(inst).__module__}.{type(inst).__qualname__}",
                )
            setattr(inst, k, v)


def _container(u: Any, opcode: str, plain: type) -> Any:
    target = u.stack[-1]
    if type(target) is not plain or id(target) in u._globals:
        _check_target(u, target, opcode)
    return target


def _load_append(u: Any) -> None:
    value = u.stack.pop()
    _container(u, "APPEND", list).append(value)


def _load_appends(u: Any) -> None:
    items = u.pop_mark()
    target = _container(u, "APPENDS", list)
    extend = getattr(target, "extend", None)
    if extend is not None:
        extend(items)
        return
    for item in items:  # the protocol allows an object with append() alone
        target.append(item)


def _load_setitem(u: Any) -> None:
    value = u.stack.pop()
    key = u.stack.pop()
    _container(u, "SETITEM", dict)[key] = value


def _load_setitems(u: Any) -> None:
    items = u.pop_mark()
    target = _container(u, "SETITEMS", dict)
    for i in range(0, len(items), 2):
        target[items[i]] = items[i + 1]


def _load_additems(u: Any) -> None:
    items = u.pop_mark()
    target = _container(u, "ADDITEMS", set)
    if isinstance(target, set):
        target.update(items)
        return
    for item in items:
        target.add(item)


def _load_bytearray8(u: Any) -> None:
    (size,) = struct.unpack("<Q", u.read(8))
    out = bytearray()
    while len(out) < size:
        part = u.read(min(size - len(out), _CHUNK))
        if not part:
            raise _truncated(size, len(out))
        out += part
    u.append(out)


class _Dispatch(dict):  # type: ignore[type-arg]  # opcode -> pickle's private handlers
    def __missing__(self, key: int) -> NoReturn:
        raise MalformedPayloadError(
            f"invalid load key {bytes([key])!r}: not a pickle opcode, so the bytes are "
            "not a pickle or were cut or corrupted on the way"
        )


def guarded_dispatch() -> dict[int, Any]:
    """The pure-Python unpickler's dispatch table with the guarded opcodes replaced."""
    table = _Dispatch(pickle._Unpickler.dispatch)
    for opcode, load in (
        (pickle.BUILD, _load_build),
        (pickle.APPEND, _load_append),
        (pickle.APPENDS, _load_appends),
        (pickle.SETITEM, _load_setitem),
        (pickle.SETITEMS, _load_setitems),
        (pickle.ADDITEMS, _load_additems),
        (pickle.BYTEARRAY8, _load_bytearray8),
    ):
        table[opcode[0]] = load
    return table
