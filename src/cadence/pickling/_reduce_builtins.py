"""Reducers for built-in objects the standard pickler refuses or gets wrong.

dict views, memoryviews, ``weakref.WeakSet``, text files, the objects no pickler can
rebuild (refused with a reason), and, when torch is already imported, CPU tensors
(see [Note: zero-copy buffers]).
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import struct
import sys
import types
import weakref
from typing import Any

from cadence.pickling import _reconstructors_data
from cadence.pickling._errors import UnpicklableError
from cadence.pickling._state import DumpState

# Everything not listed here is private to cadence.pickling.
__all__ = ["BUILTIN_REDUCERS", "SUBCLASS_REDUCERS", "StorageRef", "torch_reducers"]

# ---------------------------------------------------------------------------------------
# dict views
# ---------------------------------------------------------------------------------------


def _keys_reduce(state: DumpState, view: Any) -> Any:
    return _reconstructors_data._make_dict_keys, (list(view),)


def _values_reduce(state: DumpState, view: Any) -> Any:
    return _reconstructors_data._make_dict_values, (list(view),)


def _items_reduce(state: DumpState, view: Any) -> Any:
    return _reconstructors_data._make_dict_items, (dict(view),)


def _odict_keys_reduce(state: DumpState, view: Any) -> Any:
    return _reconstructors_data._make_dict_keys, (list(view), True)


def _odict_values_reduce(state: DumpState, view: Any) -> Any:
    return _reconstructors_data._make_dict_values, (list(view), True)


def _odict_items_reduce(state: DumpState, view: Any) -> Any:
    return _reconstructors_data._make_dict_items, (dict(view), True)


# ---------------------------------------------------------------------------------------
# Buffers
# ---------------------------------------------------------------------------------------
# [Note: zero-copy buffers] Under protocol 5 a C-contiguous buffer (a memoryview, a CPU
# tensor's storage, a numpy array through numpy's own reduce) travels as a
# ``pickle.PickleBuffer``: with a ``buffer_callback`` the pickler hands the buffer itself
# to the callback and writes no byte of it (out of band), and the loader rebuilds the
# object over whatever buffer it is given, without copying. Without a callback, or under
# protocol 4, the bytes are written into the payload (one copy, unavoidable). A buffer
# that is not C-contiguous is copied into C order first. At load, a read-only buffer
# (``bytes``) behind an object that was writable is copied once, so writes to the loaded
# object can never reach memory the loader did not hand over as writable.


@functools.lru_cache(maxsize=64)
def _castable(fmt: str) -> bool:
    try:
        # typeshed accepts only literal formats; this one is data, tried here.
        memoryview(bytes(struct.calcsize(fmt))).cast(fmt)  # type: ignore[call-overload]  # the format is data (see above)
    except (ValueError, TypeError, struct.error):
        return False
    return True


def _memoryview_reduce(state: DumpState, view: memoryview) -> Any:
    fmt, shape = view.format, tuple(view.shape or ())
    if not _castable(fmt):
        # memoryview.cast only makes native single-character formats; a struct layout
        # (numpy record dtypes) comes back as the same bytes, viewed as unsigned bytes.
        fmt, shape = "B", (view.nbytes,)
    if state.protocol >= 5 and view.c_contiguous:
        buffer: Any = pickle.PickleBuffer(view)
    else:
        buffer = view.tobytes()
    return _reconstructors_data._make_memoryview, (buffer, fmt, shape, view.readonly)


def _weakset_reduce(state: DumpState, ws: weakref.WeakSet[Any]) -> Any:
    # The members travel as a list: memoized like any other reference, so a member that
    # is also referenced elsewhere in the payload is the same object in the loaded
    # WeakSet (one that is not dies at load, as it would have here).
    return weakref.WeakSet, (list(ws),)


# ---------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------


def _text_file_reduce(state: DumpState, f: io.TextIOWrapper) -> Any:
    # sys.stdout and sys.stderr are the loading process's own; any other text file
    # opened for reading travels as a snapshot of its contents and position (as in
    # cloudpickle).
    if f is sys.stdout:
        return getattr, (sys, "stdout")
    if f is sys.stderr:
        return getattr, (sys, "stderr")
    name = getattr(f, "name", "?")
    why = None
    if f is sys.stdin:
        why = "it is standard input"
    elif f.closed:
        why = "it is closed"
    elif f.isatty():
        why = "it is a terminal"
    elif "r" not in f.mode and "+" not in f.mode:
        why = f"it is not open for reading (mode {f.mode!r})"
    if why is None:
        try:
            position = f.tell()
            f.seek(0)
            contents = f.read()
            f.seek(position)
        except OSError as exc:
            why = f"it cannot be read ({exc})"
        else:
            return _reconstructors_data._make_text_file, (contents, name, position)
    raise UnpicklableError(f"cannot pickle the file {name!r}: {why}")


# ---------------------------------------------------------------------------------------
# Refused outright
# ---------------------------------------------------------------------------------------


def _refuse_reduce(state: DumpState, obj: Any) -> Any:
    # Refuse up front with a message that says why; the C pickler's own
    # "cannot pickle 'generator' object" does not.
    kind = type(obj).__name__
    what = getattr(obj, "__qualname__", None) or kind
    raise UnpicklableError(
        f"cannot pickle {kind} object {what!r}: a {kind} holds a live, suspended frame "
        "that no pickler can rebuild; pickle the function that creates it (and its "
        "arguments) instead"
    )


BUILTIN_REDUCERS: dict[type, Any] = {
    type({}.keys()): _keys_reduce,
    type({}.values()): _values_reduce,
    type({}.items()): _items_reduce,
    type(collections.OrderedDict().keys()): _odict_keys_reduce,
    type(collections.OrderedDict().values()): _odict_values_reduce,
    type(collections.OrderedDict().items()): _odict_items_reduce,
    memoryview: _memoryview_reduce,
    weakref.WeakSet: _weakset_reduce,
    io.TextIOWrapper: _text_file_reduce,
    types.GeneratorType: _refuse_reduce,
    types.CoroutineType: _refuse_reduce,
    types.AsyncGeneratorType: _refuse_reduce,
    types.FrameType: _refuse_reduce,
    types.TracebackType: _refuse_reduce,
}

# Reducers that also serve subclasses (pytest's capture streams subclass TextIOWrapper).
# The dispatcher looks these up once per new type and caches the answer by exact type.
SUBCLASS_REDUCERS: dict[type, Any] = {io.TextIOWrapper: _text_file_reduce}


# ---------------------------------------------------------------------------------------
# torch tensors
# ---------------------------------------------------------------------------------------
# torch's own reduce writes a tensor's storage through torch.save into a bytes object:
# always in band, always copied. A plain CPU tensor is reduced here instead to its storage
# (a PickleBuffer over a uint8 view of it, see [Note: zero-copy buffers]) plus offset,
# size, stride, dtype and requires_grad, which is everything torch's reduce keeps. The
# storage stand-in is cached per storage, so views of one storage still share it after
# loading. Anything else (other devices and layouts, subclasses, non-leaf tensors, tensors
# with hooks, names or Python attributes) keeps torch's own reduce. The zero-copy view of
# the storage comes from numpy; without numpy, torch's reduce is used.


class StorageRef:
    __slots__ = ("buffer",)

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer

    def __reduce__(self) -> Any:
        return _reconstructors_data._make_storage, (self.buffer,)


def _plain_cpu_tensor(torch: Any, t: Any) -> bool:
    return bool(
        t.device.type == "cpu"
        and t.layout is torch.strided
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and not any(n is not None for n in getattr(t, "names", None) or ())
        and t.grad_fn is None
        and not t._backward_hooks
        and not vars(t)
    )


def _tensor_reduce(state: DumpState, t: Any) -> Any:
    torch = sys.modules["torch"]
    if not _plain_cpu_tensor(torch, t):
        return NotImplemented
    storage = t.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes())
    ref = state.storages.get(key)
    if ref is None:
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        try:
            array = whole.numpy()
        except (RuntimeError, ImportError, TypeError):  # no numpy: torch's own reduce
            return NotImplemented
        buffer = pickle.PickleBuffer(array) if state.protocol >= 5 else array.tobytes()
        ref = state.storages[key] = StorageRef(buffer)
        state.keepalive.append(storage)
    return _reconstructors_data._make_tensor, (
        ref, t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.requires_grad,
    )  # fmt: skip


def torch_reducers() -> dict[type, Any]:
    """Reducers for torch types, once torch is imported (never imports it)."""
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    if not isinstance(tensor, type):  # not imported, or still importing
        return {}
    return {tensor: _tensor_reduce}
