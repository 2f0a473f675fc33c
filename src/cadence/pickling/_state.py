"""The per-dump state the reducers share: caches keyed by object id.

A reducer receives this object, never the pickler itself, so the reducers, the error
path walk and the pickler depend on this module and not on each other.
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
        "protocol",
        "pruned",
        "set_proxies",
        "storages",
        "table",
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
        # The pickler's dispatch_table (set by the user on the instance), read per dump.
        self.table: Any = None

    def restart(self) -> None:
        """Forget everything a failed attempt cached, except what it decided to prune."""
        self.last = None
        self.closure_cells.clear()
        self.globals_skeletons.clear()
        self.set_proxies.clear()
        self.storages.clear()
