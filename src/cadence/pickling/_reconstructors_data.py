"""Reconstructors for built-in data the standard pickler refuses: views, buffers, files.

Like those in ``_reconstructors``, a payload names these by module and name, so
[Note: payload format] applies. None of them builds code: they are the reconstructors
`Allowlist` admits by default (``data=True``), except those that return an attribute of a
class (``_class_dict_entry``) or need torch (``_make_storage``, ``_make_tensor``).
"""

from __future__ import annotations

import collections
import functools
import io
import sys
from typing import Any

# Everything not listed here is private to cadence.pickling.
__all__ = [
    "_class_dict_entry",
    "_make_cached_property",
    "_make_dict_items",
    "_make_dict_keys",
    "_make_dict_values",
    "_make_memoryview",
    "_make_storage",
    "_make_tensor",
    "_make_text_file",
]


# ---------------------------------------------------------------------------------------
# dict views
# ---------------------------------------------------------------------------------------
# A view travels as the data it shows, not as the whole dict behind it (a ``keys()``
# view of a dict of secrets must not ship the secrets), rebuilt over a fresh dict or
# OrderedDict so the loaded view has the type of the original.


def _make_dict_keys(keys: list[Any], ordered: bool = False) -> Any:
    return (collections.OrderedDict if ordered else dict).fromkeys(keys).keys()


def _make_dict_values(values: list[Any], ordered: bool = False) -> Any:
    return (collections.OrderedDict if ordered else dict)(enumerate(values)).values()


def _make_dict_items(items: dict[Any, Any], ordered: bool = False) -> Any:
    return (collections.OrderedDict(items) if ordered else items).items()


# ---------------------------------------------------------------------------------------
# memoryview
# ---------------------------------------------------------------------------------------


def _make_memoryview(buffer: Any, fmt: str, shape: tuple[int, ...], readonly: bool) -> memoryview:
    """A memoryview of ``format``/``shape`` over ``buffer``, without copying it.

    ``buffer`` is whatever the unpickler handed over: a ``PickleBuffer`` or the caller's
    own buffer (out of band), ``bytes`` or ``bytearray`` (in band). A view that was
    writable stays writable when the buffer is; one that was read-only is made
    read-only again.
    """
    view = memoryview(buffer)
    if view.readonly and not readonly:
        view = memoryview(bytearray(view))  # the only copy: a writable view was asked for
    if view.ndim != 1 or view.format not in ("B", "@B"):
        view = view.cast("B")
    if fmt != "B" or shape != (view.nbytes,):
        # typeshed accepts only literal formats; this one is data (_castable checked
        # it when the payload was made).
        view = view.cast(fmt, shape)  # type: ignore[call-overload]  # the format is data (see above)
    return view.toreadonly() if readonly and not view.readonly else view


# ---------------------------------------------------------------------------------------
# Descriptors and other class attributes
# ---------------------------------------------------------------------------------------


def _class_dict_entry(cls: type, name: str) -> Any:
    # ``getattr(float, "fromhex")`` gives a bound method, not the classmethod_descriptor
    # in the class dict: look in the dict itself.
    if not isinstance(cls, type):
        raise TypeError(f"expected a class, got {type(cls).__name__}")
    return cls.__dict__[name]


def _make_cached_property(func: Any, attrname: str | None, doc: Any) -> Any:
    prop = functools.cached_property(func)
    if attrname is not None:
        # cached_property reads only the name; the owner class does not exist yet.
        prop.__set_name__(None, attrname)  # type: ignore[arg-type]  # no owner class yet (see above)
    prop.__doc__ = doc
    return prop


def _make_text_file(contents: str, name: Any, position: int) -> io.StringIO:
    # A snapshot of a text file opened for reading, as cloudpickle ships one.
    f = io.StringIO(contents)
    f.seek(position)
    f.name = name
    return f


# ---------------------------------------------------------------------------------------
# torch tensors (only reached when the payload holds one, so torch is importable)
# ---------------------------------------------------------------------------------------


def _make_storage(buffer: Any) -> Any:
    """A uint8 tensor over ``buffer``: the whole storage of the original tensor(s).

    Zero-copy when the buffer is writable. torch has no read-only tensors, so a
    read-only buffer (``bytes`` from the wire) is copied once rather than handed to
    ``torch.frombuffer``, which would let a later in-place op write into it.
    """
    torch = sys.modules.get("torch") or __import__("torch")
    view = memoryview(buffer)
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if view.readonly:
        view = memoryview(bytearray(view))
    if view.ndim != 1 or view.format not in ("B", "@B"):
        view = view.cast("B")
    return torch.frombuffer(view, dtype=torch.uint8)


def _make_tensor(
    storage: Any,
    dtype: Any,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
) -> Any:
    torch = sys.modules.get("torch") or __import__("torch")
    t = torch.empty(0, dtype=dtype).set_(storage.untyped_storage(), offset, size, stride)
    if requires_grad:
        t.requires_grad_(True)
    return t
