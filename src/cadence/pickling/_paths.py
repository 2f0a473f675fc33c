"""Error paths: where, in the object graph, the object that failed to pickle sits.

The C pickler does not say which container it was in when a reduce raised. The pickler
records the last object ``reducer_override`` saw; after a failure, a breadth-first walk
from the root finds it by identity, along the same edges the reducers follow, and gives
a path such as ``make.<locals>.fn.__closure__['cfg'].lock``. Each step also says whether
its edge is an *optional* function slot (see [Note: slot policy]), which is how the
pickler decides what it may prune. The walk runs only after a failure, so it costs
nothing on a successful dump. It is iterative (a queue, not recursion), so it also runs
after a RecursionError, once the stack has unwound.
"""

from __future__ import annotations

import functools
import types
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

from cadence.pickling._lookup import code_global_names, lookup_by_reference
from cadence.pickling._state import DumpState

# Everything not listed here is private to cadence.pickling.
__all__ = ["Step", "deepest_path", "find_path", "format_path", "root_label"]

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), type(Ellipsis))
_MAX_NODES = 200_000


class Step(NamedTuple):
    label: str
    owner: Any
    child: Any
    # ("__dict__", key), ("__doc__",), ("__annotations__", key), ("__type_params__",)
    # when the edge is an optional function slot; None otherwise.
    slot: tuple[Any, ...] | None


def _attr_label(name: Any) -> str:
    return f".{name}" if isinstance(name, str) and name.isidentifier() else f"[{name!r}]"


def _function_children(func: types.FunctionType) -> Iterator[Step]:
    if lookup_by_reference(func):
        return
    code = func.__code__
    g = func.__globals__
    for n in code_global_names(code):
        if n in g and n != "__builtins__":
            yield Step(f".__globals__[{n!r}]", func, g[n], None)
    for name, cell in zip(code.co_freevars, func.__closure__ or ()):
        try:
            yield Step(f".__closure__[{name!r}]", func, cell.cell_contents, None)
        except ValueError:
            pass
    for i, v in enumerate(func.__defaults__ or ()):
        yield Step(f".__defaults__[{i}]", func, v, None)
    for k, v in (func.__kwdefaults__ or {}).items():
        yield Step(f".__kwdefaults__[{k!r}]", func, v, None)
    for k, v in func.__dict__.items():
        yield Step(_attr_label(k), func, v, ("__dict__", k))
    if func.__doc__ is not None and not isinstance(func.__doc__, str):
        yield Step(".__doc__", func, func.__doc__, ("__doc__",))
    for k, v in func.__annotations__.items():
        yield Step(f".__annotations__[{k!r}]", func, v, ("__annotations__", k))
    tp = getattr(func, "__type_params__", None)
    if tp:
        yield Step(".__type_params__", func, tp, ("__type_params__",))


def _children(obj: Any, protocol: int) -> Iterator[Step]:
    t = type(obj)
    if t in _ATOMS or t is types.ModuleType:
        return
    if t is types.FunctionType:
        yield from _function_children(obj)
    elif t is types.MethodType:
        yield Step(".__func__", obj, obj.__func__, None)
        yield Step(".__self__", obj, obj.__self__, None)
    elif t is types.CellType:
        try:
            yield Step(".cell_contents", obj, obj.cell_contents, None)
        except ValueError:
            pass
    elif isinstance(obj, functools.partial):
        yield Step(".func", obj, obj.func, None)
        for i, v in enumerate(obj.args):
            yield Step(f".args[{i}]", obj, v, None)
        for k, v in obj.keywords.items():
            yield Step(f".keywords[{k!r}]", obj, v, None)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield Step(f"[{k!r}]", obj, v, None)
            yield Step(f"<key {k!r}>", obj, k, None)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield Step(f"[{i}]", obj, v, None)
    elif isinstance(obj, (set, frozenset)):
        for v in obj:
            yield Step("<element>", obj, v, None)
    elif isinstance(obj, type):
        if lookup_by_reference(obj) or obj.__module__ == "builtins":
            return
        for k, v in list(vars(obj).items()):
            if k not in ("__dict__", "__weakref__"):
                yield Step(_attr_label(k), obj, v, None)
    else:
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            for k, v in d.items():
                yield Step(_attr_label(k), obj, v, None)
        for klass in t.__mro__:
            for slot in klass.__dict__.get("__slots__", ()):
                if slot in ("__dict__", "__weakref__"):
                    continue
                try:
                    yield Step(f".{slot}", obj, object.__getattribute__(obj, slot), None)
                except Exception:
                    pass
        if d is None:
            # No __dict__: fall back to what its own reduce hands the pickler.
            try:
                rv = obj.__reduce_ex__(protocol)
            except Exception:
                return
            if isinstance(rv, tuple):
                for i, v in enumerate(rv[1] if len(rv) > 1 else ()):
                    yield Step(f"<reduce arg {i}>", obj, v, None)
                if len(rv) > 2 and rv[2] is not None:
                    yield Step("<state>", obj, rv[2], None)


_DEEPEST = object()


def find_path(state: DumpState, root: Any, target: Any) -> list[Step] | None:
    """The shortest path from ``root`` to ``target`` (by identity), or None."""
    return _walk(state, root, target)


def deepest_path(state: DumpState, root: Any) -> list[Step] | None:
    """A path from ``root`` to one of the most deeply nested objects it reaches.

    The C pickler calls ``reducer_override`` for neither lists nor dicts nor tuples, so
    when a nest of those exhausts the stack no recorded object says where: the deepest
    point of the graph does.
    """
    return _walk(state, root, _DEEPEST)


def _walk(state: DumpState, root: Any, target: Any) -> list[Step] | None:
    if root is target:
        return []
    parents: dict[int, Step | None] = {id(root): None}
    keep = [root]  # ids are only meaningful while the objects live
    queue = deque([root])
    last: Step | None = None
    while queue and len(parents) < _MAX_NODES:
        node = queue.popleft()
        try:
            children = list(_children(node, state.protocol))
        except Exception:
            continue
        for step in children:
            if step.slot is not None and step.slot in state.pruned.get(id(step.owner), ()):
                continue  # pruned on an earlier try: the pickler no longer follows it
            cid = id(step.child)
            if cid in parents:
                continue
            parents[cid] = last = step
            keep.append(step.child)
            if step.child is target:
                return _trace(parents, step)
            queue.append(step.child)
    # Breadth first: the last step taken reaches as deep as the walk went.
    return _trace(parents, last) if target is _DEEPEST and last is not None else None


def _trace(parents: dict[int, Step | None], step: Step) -> list[Step]:
    path: list[Step] = []
    s: Step | None = step
    while s is not None:
        path.append(s)
        s = parents[id(s.owner)]
    return path[::-1]


def root_label(root: Any) -> str:
    # Only type() and slots of the built-in types are read: the root may be an object
    # whose __getattribute__ raises, or recurses without end.
    t = type(root)
    if t is types.FunctionType:
        return str(root.__qualname__)
    if issubclass(t, type):  # a class, whatever its metaclass
        return str(type.__dict__["__qualname__"].__get__(root))
    return "obj"


_MAX_SHOWN = 24


def format_path(root: Any, path: list[Step]) -> str:
    """``root.a[0]...``; a very long path (a deep nest) shows its two ends."""
    labels = [s.label for s in path]
    if len(labels) > _MAX_SHOWN:
        half = _MAX_SHOWN // 2
        hidden = len(labels) - 2 * half
        labels = [*labels[:half], f"...({hidden} more steps)...", *labels[-half:]]
    return root_label(root) + "".join(labels)
