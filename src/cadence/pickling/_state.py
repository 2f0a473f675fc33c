"""The per-dump state the reducers share: caches keyed by object id.

A reducer receives this object, never the pickler itself, so the reducers, the error
path walk and the pickler depend on this module and not on each other.

[Note: names in the payload] The pickler memoizes strings by identity: two references
to one str object are written once, two equal str objects twice. Identifiers are
interned by the compiler, so in the defining process a method named ``join``, a
variable ``join`` and a dataclass field ``"join"`` are one object; in a process that
loaded them, CodeType() and setattr() intern some of them again and the unpickler
interns none, so they are several objects. Re-pickling what was loaded would then give
other bytes. So every name the reducers take from code objects, class dicts and function
dicts goes through ``DumpState.name``: a copy made once per payload and per value. All
those names share that copy (written once), and no string outside them ever is it, in
any process.
"""

from __future__ import annotations

from typing import Any

# Everything not listed here is private to cadence.pickling.
__all__ = ["DumpState"]


class DumpState:
    """Caches of one dump; the pickler empties them before each attempt.

    Every cache is keyed by ``id()``. An id is only meaningful while its object lives,
    so each cached object is kept alive (as a value, or in ``keepalive``) until the dump
    ends: otherwise a temporary made during the dump could die and a later temporary
    reuse its id and hit the wrong entry.
    """

    __slots__ = (
        "closure_cells",
        "globals_skeletons",
        "keepalive",
        "last",
        "names",
        "protocol",
        "pruned",
        "set_proxies",
        "storages",
    )

    def __init__(self, protocol: int) -> None:
        self.protocol = protocol
        # The last object ``reducer_override`` saw: after a failure, the object whose
        # reduce raised (the error path walk looks for it).
        self.last: Any = None
        # Cells that belong to a function being pickled (they travel empty and are
        # filled by the function's state).
        self.closure_cells: dict[int, Any] = {}
        # id(func.__globals__) -> the skeleton dict its functions share in the payload.
        self.globals_skeletons: dict[int, dict[str, Any]] = {}
        # id(set) -> its sorted stand-in (see [Note: deterministic containers]).
        self.set_proxies: dict[int, Any] = {}
        # id(tensor storage) -> its stand-in, so views of one storage share it.
        self.storages: dict[Any, Any] = {}
        # id(function) -> optional slots to leave out (see [Note: prune by retry]). It
        # survives a restart: it is what the restart is for.
        self.pruned: dict[int, set[tuple[Any, ...]]] = {}
        self.keepalive: list[Any] = []
        # str -> this payload's own copy of it (see [Note: names in the payload]).
        self.names: dict[str, str] = {}

    def name(self, s: str) -> str:
        """This payload's copy of the identifier ``s`` (see [Note: names in the payload])."""
        copy = self.names.get(s)
        if copy is None:
            # "".join makes a new object, except for one character, where it gives the
            # string back: use the interpreter's singleton then, as canonical() does.
            one = len(s) == 1 and s < "\u0100"
            copy = self.names[s] = chr(ord(s)) if one else "".join(s)
        return copy

    def restart(self) -> None:
        """Forget everything a failed attempt cached, except what it decided to prune."""
        self.last = None
        self.closure_cells.clear()
        self.globals_skeletons.clear()
        self.set_proxies.clear()
        self.storages.clear()
        self.names.clear()
