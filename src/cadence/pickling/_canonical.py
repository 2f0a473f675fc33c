"""Deterministic payloads: sets written in sorted order, names written as copies.

[Note: deterministic containers] The C pickler writes a set in its iteration order,
which for ``str`` elements changes with PYTHONHASHSEED, and it never consults
``reducer_override`` for an exact ``set`` or ``frozenset``. So wherever a reducer hands
values to the pickler (globals, closure contents, defaults, ``__dict__``, class
attributes, code constants, an instance's state, tuples, the top-level object) a set is
swapped for a stand-in that reduces to ``set(sorted_elements)``. The stand-in is cached
per set, so a set reached twice is still one object in the payload. A set nested inside
a *list* or a *dict* is not swapped: copying a mutable container to sort its sets would
break aliasing (two references to one list would load as two lists).
"""

from __future__ import annotations

from typing import Any

from cadence.pickling._state import DumpState

# Everything not listed here is private to cadence.pickling.
__all__ = [
    "SortedSet",
    "canonical",
    "canonical_dict",
    "has_set",
    "name",
    "name_cache_generation",
    "stable_sorted",
]


# [Note: names in the payload] The pickler memoizes strings by identity: two references
# to one str object are written once, two equal str objects twice. Identifiers are
# interned by the compiler, so in the defining process a method named ``join``, a
# variable ``join`` and a dataclass field ``"join"`` are one object; in a process that
# loaded them, CodeType() and setattr() intern some of them again and the unpickler
# interns none, so they are several objects. Re-pickling what was loaded would then give
# other bytes. So every name the reducers take from code objects, class dicts, function
# dicts and module namespaces goes through :func:`name`, which returns this process's
# private copy of it: all those names share that copy (written once per payload), and no
# object outside the pickler ever holds it, in any process. One-character strings are
# the interpreter's shared singletons instead, as the unpickler makes them.

_NAMES: dict[str, str] = {}
_NAMES_LIMIT = 1 << 16
_generation = [0]


def name(s: str) -> str:
    """This process's private copy of the identifier ``s`` (see [Note: names in the payload])."""
    copy = _NAMES.get(s)
    if copy is None:
        if len(_NAMES) >= _NAMES_LIMIT:
            # Code that mints names without end: start over. Caches that hold copies
            # (the code object cache) check the generation and start over too.
            _NAMES.clear()
            _generation[0] += 1
        one = len(s) == 1 and s < "\u0100"
        copy = _NAMES[s] = chr(ord(s)) if one else "".join(s)
    return copy


def name_cache_generation() -> int:
    return _generation[0]


class SortedSet:
    """Stands in for a set or frozenset; reduces to the same type, elements sorted."""

    __slots__ = ("items", "kind")

    def __init__(self, kind: type, items: list[Any]) -> None:
        self.kind = kind
        self.items = items

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.kind, (self.items if self.kind is set else tuple(self.items),))


def stable_sorted(values: Any) -> list[Any]:
    """Sorted by value; mixed or unorderable elements by type name, then ``repr``."""
    try:
        return sorted(values)
    except TypeError:
        return sorted(values, key=lambda v: (type(v).__qualname__, repr(v)))


_SET_TYPES = (set, frozenset)


def canonical(state: DumpState, value: Any) -> Any:
    t = type(value)
    if t is str:
        # A one-character string loads as the interpreter's shared singleton for that
        # character, so a process that loaded it shares it with every equal one; the
        # compiler may have made a separate object. Write the singleton, as a loaded
        # payload would (see [Note: names in the payload]).
        return chr(ord(value)) if len(value) == 1 and value < "\u0100" else value
    if t is set or t is frozenset:
        proxy = state.set_proxies.get(id(value))
        if proxy is None:
            proxy = SortedSet(t, stable_sorted(value))
            state.set_proxies[id(value)] = proxy
            state.keepalive.append(value)
        return proxy
    if t is tuple and value:
        # Tuples are immutable, so a copy with stand-ins inside is safe; keep the
        # original when nothing changed so memoization still shares it.
        new = tuple(canonical(state, v) for v in value)
        if any(a is not b for a, b in zip(new, value)):
            return new
    return value


def canonical_dict(state: DumpState, d: dict[Any, Any]) -> dict[Any, Any]:
    return {k: canonical(state, v) for k, v in d.items()}


def has_set(values: Any) -> bool:
    # A plain loop: it runs for every instance dict the pickler meets, and any() over a
    # generator costs a frame per call.
    for v in values:  # noqa: SIM110
        if type(v) in _SET_TYPES:
            return True
    return False
