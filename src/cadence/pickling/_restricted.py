"""Restricted loading: an unpickler that only resolves the globals an allowlist names.

[Note: what a restricted load protects] Every way a pickle runs code goes through a
global: the unpickler imports a callable by ``module`` and ``name`` (``find_class``)
before anything can call it. A payload that holds a function by value names
``cadence.pickling._reconstructors._make_code``; a malicious one names ``os.system`` or
``builtins.eval``. ``RestrictedUnpickler.find_class`` resolves only what the
`Allowlist` admits and refuses anything else with `ForbiddenGlobalError` naming the
global, before it is called. So a restricted load of a payload from a semi-trusted peer
can build only the allowed types, and it can never rebuild a function by value (that is
code execution by construction; keep such payloads to `loads_signed`).

It does not protect against a payload that is merely large (a memory bomb), nor against
an allowed class whose own ``__setstate__`` or constructor misbehaves on hostile
arguments: allow data types, not callables with side effects.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import types
from collections.abc import Iterable
from typing import Any

from cadence.pickling._errors import ForbiddenGlobalError

# Everything not listed here is private to cadence.pickling.
__all__ = ["Allowlist", "RestrictedUnpickler", "load_restricted", "loads_restricted"]

# Plain data: built-in value types, standard containers, and cadence's own data
# reconstructors (dict views, memoryviews). None of them runs code from the payload.
_DATA_GLOBALS = frozenset(
    {
        *(f"builtins.{n}" for n in (
            "bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int",
            "list", "object", "range", "set", "slice", "str", "tuple",
        )),
        "collections.OrderedDict", "collections.Counter", "collections.defaultdict",
        "collections.deque",
        "datetime.date", "datetime.datetime", "datetime.time", "datetime.timedelta",
        "datetime.timezone",
        "decimal.Decimal", "fractions.Fraction", "uuid.UUID",
        "copyreg._reconstructor", "_codecs.encode",
        *(f"cadence.pickling._reconstructors_data.{n}" for n in (
            "_make_dict_keys", "_make_dict_values", "_make_dict_items", "_make_memoryview",
        )),
    }
)  # fmt: skip

# Modules that may never be allowed wholesale: each holds a callable that runs
# arbitrary code (eval, exec, __import__, system, the code reconstructors). Name the
# globals you need one by one instead.
_NEVER_WHOLE = ("builtins", "os", "sys", "subprocess", "cadence.pickling")


def _as_names(value: Any, field: str) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TypeError(
            f"Allowlist({field}=...) takes a list of names, got the string {value!r}; "
            f"write {field}=[{value!r}]"
        )
    names = tuple(value)
    for n in names:
        if not isinstance(n, str) or not n or n.startswith(".") or n.endswith("."):
            raise ValueError(f"Allowlist({field}=...): {n!r} is not a dotted name")
    return names


@dataclasses.dataclass(frozen=True)
class Allowlist:
    """The globals a restricted load may resolve.

    ``modules``: ``"pkg.mod"`` admits the classes and functions defined in that module;
    ``"pkg.*"`` admits those of ``pkg`` and all its submodules. ``globals``: exact
    ``"module.qualname"`` names. ``data`` (default True) admits built-in value types,
    the standard containers and cadence's dict-view and memoryview reconstructors.

    A global reached through an allowed module must also be *defined* in an allowed
    module (its ``__module__``), so neither ``mypkg.os.system`` nor a ``system`` that
    ``mypkg`` imported from ``os`` slips through an allowed ``mypkg``; modules themselves
    are never returned.
    """

    modules: tuple[str, ...] = ()
    globals: tuple[str, ...] = ()
    data: bool = True

    # numpy arrays and scalars as numpy 1.x and 2.x pickle them.
    NUMPY = (
        *(f"numpy.{core}.{n}"
          for core in ("core", "_core")
          for n in ("multiarray._reconstruct", "multiarray.scalar", "numeric._frombuffer")),
        "numpy.ndarray",
        "numpy.dtype",
    )  # fmt: skip
    # torch CPU tensors as cadence pickles them, and their dtypes.
    TORCH = (
        "cadence.pickling._reconstructors_data._make_storage",
        "cadence.pickling._reconstructors_data._make_tensor",
        "torch._utils._rebuild_parameter",
        *(f"torch.{d}" for d in (
            "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32",
            "uint64", "float16", "bfloat16", "float32", "float64", "complex64",
            "complex128", "float8_e4m3fn", "float8_e5m2",
        )),
    )  # fmt: skip

    def __post_init__(self) -> None:
        modules = _as_names(self.modules, "modules")
        for m in modules:
            base = m[:-2] if m.endswith(".*") else m
            if base in _NEVER_WHOLE or any(base.startswith(p + ".") for p in _NEVER_WHOLE):
                raise ValueError(
                    f"Allowlist(modules=...) may not admit {m!r} as a whole: it holds "
                    "callables that run arbitrary code; list the globals you need in "
                    "Allowlist(globals=[...]) instead"
                )
        object.__setattr__(self, "modules", modules)
        object.__setattr__(self, "globals", _as_names(self.globals, "globals"))
        if not isinstance(self.data, bool):
            raise TypeError(f"Allowlist(data=...) must be True or False, got {self.data!r}")

    def _module_allowed(self, module: str) -> bool:
        for m in self.modules:
            if m.endswith(".*"):
                base = m[:-2]
                if module == base or module.startswith(base + "."):
                    return True
            elif module == m:
                return True
        return False

    def _name_allowed(self, full: str) -> bool:
        return full in self.globals or (self.data and full in _DATA_GLOBALS)


class RestrictedUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` whose ``find_class`` admits only an `Allowlist`.

    Safe for payloads from peers you do not fully trust, to the extent that the allowed
    globals are (see the module docs); refusals raise `ForbiddenGlobalError` naming the
    global. Python 2 module renames are not applied, so names are checked as written.
    """

    def __init__(self, file: Any, allow: Allowlist, **kwargs: Any) -> None:
        if not isinstance(allow, Allowlist):
            raise TypeError(
                f"allow= takes a cadence.pickling.Allowlist, got {type(allow).__name__}; "
                "write Allowlist(modules=[...], globals=[...])"
            )
        kwargs.setdefault("fix_imports", False)
        super().__init__(file, **kwargs)
        self._allow = allow

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        allow = self._allow
        if allow._name_allowed(full):
            return super().find_class(module, name)
        if allow._module_allowed(module):
            obj = super().find_class(module, name)
            defined_in = getattr(obj, "__module__", None)
            if isinstance(obj, types.ModuleType):
                why = "it is a module (a payload could rewrite the module's globals)"
            elif isinstance(defined_in, str) and not allow._module_allowed(defined_in):
                why = f"it is defined in {defined_in!r}, which is not allowed"
            else:
                return obj
        else:
            why = "neither it nor its module is in the allowlist"
        raise ForbiddenGlobalError(
            f"refused to load the global {full!r}: {why}. Allow it with "
            f"Allowlist(globals=[{full!r}]) only if every payload that may name it is "
            "trusted to call it",
            full,
        )


def loads_restricted(data: bytes, allow: Allowlist, *, buffers: Iterable[Any] | None = None) -> Any:
    """Load ``data`` resolving only the globals ``allow`` admits.

    Raises `ForbiddenGlobalError` (an ``UnpicklingError``) naming the first refused
    global. ``buffers`` are the out-of-band buffers, as for ``pickle.loads``.
    """
    return RestrictedUnpickler(io.BytesIO(data), allow, buffers=buffers).load()


def load_restricted(file: Any, allow: Allowlist, *, buffers: Iterable[Any] | None = None) -> Any:
    """Load one pickle from the binary file ``file``; see :func:`loads_restricted`."""
    return RestrictedUnpickler(file, allow, buffers=buffers).load()
