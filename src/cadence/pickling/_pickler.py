"""The Pickler, and the dumps/dump shorthands.

``Pickler`` subclasses the C ``pickle.Pickler``: everything the standard pickler handles
natively stays native, and only functions, classes and a handful of types
(``_reducers.REDUCERS``) take a Python detour through ``reducer_override``. The output
loads with plain ``pickle.loads``; the loading process needs ``cadence`` importable (for
the reconstructors) and, for by-reference objects, their modules.

[Note: prune by retry] Optional slots that do not pickle are pruned, but not by probing
each slot before dumping it, which would dump every ``__wrapped__`` chain twice. The dump
runs optimistically; on failure, the error-path walk (``_paths``) finds the failing
object, and if the innermost edge leading to it is an optional function slot, that slot
is marked pruned and the dump restarts from a clean buffer and memo. A failure reached
only through call-critical slots is raised, with its path. A successful dump costs
nothing extra; each pruned slot costs one restart.
"""

from __future__ import annotations

import io
import pickle
import sys
import warnings
from typing import Any

from cadence.pickling._canonical import canonical
from cadence.pickling._errors import PrunedSlotWarning, RecursionDepthError
from cadence.pickling._paths import Step, deepest_path, find_path, format_path, root_label
from cadence.pickling._reducers import DISPATCH, dispatch, register_optional_reducers
from cadence.pickling._state import DumpState

# Everything not listed here is private to cadence.pickling.
__all__ = ["DEFAULT_PROTOCOL", "Pickler", "dump", "dumps", "load", "loads"]

DEFAULT_PROTOCOL = pickle.HIGHEST_PROTOCOL
_MAX_PRUNES = 64

_cached_reducer = DISPATCH.get


class Pickler(pickle.Pickler):
    """A by-value function pickler, compatible with cloudpickle's ``Pickler``.

    Subclass it and override ``reducer_override`` (call ``super()`` for what you do not
    handle) or set ``dispatch_table`` as with the standard pickler.
    """

    def __init__(self, file: Any, protocol: int | None = None, buffer_callback: Any = None) -> None:
        if protocol is None:
            protocol = DEFAULT_PROTOCOL
        register_optional_reducers()
        self._file = file
        # The whole payload is built in memory first, so a dump that must restart (see
        # [Note: prune by retry]) never leaves half a payload in the caller's file.
        self._buf = io.BytesIO()
        super().__init__(self._buf, protocol=protocol, buffer_callback=buffer_callback)
        self._state = DumpState(int(protocol))

    def reducer_override(self, obj: Any) -> Any:
        state = self._state
        state.last = obj
        t = type(obj)
        reducer = _cached_reducer(t)
        if reducer is None:
            reducer = dispatch(t)
        return reducer(state, obj)

    def dump(self, obj: Any) -> None:
        state = self._state
        state.table = getattr(self, "dispatch_table", None)
        pruned_messages: list[str] = []
        for _ in range(_MAX_PRUNES + 1):
            self._buf.seek(0)
            self._buf.truncate()
            try:
                super().dump(canonical(state, obj))
                break
            except RecursionError as exc:
                # The stack has unwound by now, so the (iterative) path walks can run.
                raise RecursionDepthError(
                    f"could not pickle {root_label(obj)}: the object graph nests deeper "
                    "than the recursion limit allows (sys.getrecursionlimit() == "
                    f"{sys.getrecursionlimit()}); reached via "
                    f"{self._where(obj, self._path_to_recursion(obj))}; flatten "
                    "the structure or raise the limit with sys.setrecursionlimit"
                ) from exc
            except Exception as exc:
                message = self._prune_or_annotate(obj, exc)
                if message is None:
                    raise
                pruned_messages.append(message)
                self.clear_memo()
                state.restart()
        else:  # pragma: no cover - needs more than _MAX_PRUNES unpicklable slots
            raise pickle.PicklingError(f"gave up after pruning {_MAX_PRUNES} slots")
        state.last = None
        for message in pruned_messages:
            warnings.warn(message, PrunedSlotWarning, stacklevel=3)
        if self._file is not None:
            self._file.write(self._buf.getvalue())

    def _path_to_last(self, root: Any) -> list[Step] | None:
        """The path from ``root`` to the object whose reduce failed, if found."""
        target = self._state.last
        return None if target is None else find_path(self._state, root, target)

    def _path_to_recursion(self, root: Any) -> list[Step] | None:
        """Where the stack ran out: the last reduced object, unless a nest of plain
        containers (which never reach reducer_override) goes much deeper."""
        path = self._path_to_last(root)
        deep = deepest_path(self._state, root)
        deep_enough = deep is not None and len(deep) > sys.getrecursionlimit() // 4
        if deep_enough and (path is None or len(deep) > len(path)):  # type: ignore[arg-type]  # deep_enough implies deep is not None
            return deep
        return path

    def _where(self, root: Any, path: list[Step] | None) -> str:
        if path is None:
            what = type(self._state.last).__name__
            return f"an object of type {what} inside {root_label(root)}"
        return format_path(root, path)

    def _prune_or_annotate(self, root: Any, exc: Exception) -> str | None:
        """Mark an optional slot pruned and return the warning, or annotate ``exc``."""
        state = self._state
        path = self._path_to_last(root)
        if path is not None:
            for i in range(len(path) - 1, -1, -1):
                step = path[i]
                if step.slot is None:
                    continue
                marks = state.pruned.setdefault(id(step.owner), set())
                if step.slot in marks:
                    break  # pruned already and still failing: give up loudly
                marks.add(step.slot)
                state.keepalive.append(step.owner)
                where = format_path(root, path[: i + 1])
                return (
                    f"cadence.pickling: dropped {step.owner.__qualname__}{step.label} "
                    f"({type(step.child).__name__}) from the payload because it does not "
                    f"pickle ({type(exc).__name__}: {exc}); reached via {where}. The "
                    "loaded function works but lacks it: make it picklable or delete it "
                    "before pickling to keep it"
                )
        _annotate(exc, f"reached via {self._where(root, path)}")
        return None


def _annotate(exc: BaseException, note: str) -> None:
    # Keep the exception object (and so its type and traceback): rewrite the message in
    # args when it is a plain string, else attach a PEP 678 note.
    if exc.args and isinstance(exc.args[0], str) and "reached via" not in exc.args[0]:
        exc.args = (f"{exc.args[0]} ({note})", *exc.args[1:])
    elif hasattr(exc, "add_note"):
        exc.add_note(note)


def dumps(obj: Any, protocol: int | None = None, buffer_callback: Any = None) -> bytes:
    """Pickle ``obj`` to bytes, functions and classes by value where needed."""
    pickler = Pickler(None, protocol=protocol, buffer_callback=buffer_callback)
    pickler.dump(obj)
    return pickler._buf.getvalue()


def dump(obj: Any, file: Any, protocol: int | None = None, buffer_callback: Any = None) -> None:
    """Pickle ``obj`` into the binary file ``file``."""
    Pickler(file, protocol=protocol, buffer_callback=buffer_callback).dump(obj)


# Loading needs nothing beyond the standard unpickler. Neither is safe for untrusted
# input: see loads_restricted and loads_signed.
load, loads = pickle.load, pickle.loads
