"""Restricted loading: an unpickler that only resolves the globals an allowlist names.

[Note: what a restricted load protects]
Every way a pickle runs code goes through a global: the unpickler imports a callable by
``module`` and ``name`` (``find_class``) before anything can call it. A payload that
holds a function by value names ``cadence.pickling._reconstructors._make_code``; a
malicious one names ``os.system`` or ``builtins.eval``. ``RestrictedUnpickler.find_class``
resolves only what the `Allowlist` admits and refuses anything else with
`ForbiddenGlobalError` naming the global, before it is called. Three more doors are
closed next to it: a dotted name may only walk through classes
([Note: dotted names walk through classes only]); an allowlist that covers cadence's
reconstructors or a module known to run code is refused when it is built
(``_dangerous``); and the opcodes that change objects refuse objects the payload did not
create ([Note: why restricted loads run the pure-Python unpickler]).

It does not protect against a payload that merely costs memory or time through an
allowed constructor (``bytearray(10**12)``), nor against an allowed class whose own
``__init__``, ``__setstate__`` or ``append`` misbehaves on hostile arguments: allow data
types, not callables with side effects. docs/pickling.md lists both sides precisely.

[Note: dotted names walk through classes only]
From protocol 4 on, a global's name may hold dots (``Outer.Inner``, a nested class), and
the standard unpickler resolves it with one ``getattr`` after another. From an allowed
function that walk reaches ``make.__builtins__.get``: a bound method of the builtins
dict whose ``__module__`` is None, so a check of the last object alone passes it, and
calling it with ``"exec"`` returns ``exec``. Here each step is checked before the next
one is taken: a dotted name may only pass through classes, and under an allowed module
each class on the way and the object it names must be defined in an allowed module, and
that object must be a class too (a nested class is what data names this way; a function
in a class body is admitted by its exact name). An exact name in ``globals=`` is the
caller's word for the object it names, but it too may only pass through classes.
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import pickle
import sys
import types
from collections.abc import Iterable
from typing import Any

from cadence.pickling._dangerous import dangerous_global, dangerous_pattern
from cadence.pickling._errors import (
    ForbiddenGlobalError,
    MalformedPayloadError,
    UnsafeAllowlistError,
)
from cadence.pickling._restricted_guards import ChunkedReader, guarded_dispatch

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

# numpy arrays and scalars as numpy 1.x and 2.x pickle them.
_NUMPY = (
    *(f"numpy.{core}.{n}"
      for core in ("core", "_core")
      for n in ("multiarray._reconstruct", "multiarray.scalar", "numeric._frombuffer")),
    "numpy.ndarray",
    "numpy.dtype",
)  # fmt: skip
# torch CPU tensors as cadence pickles them, and their dtypes.
_TORCH = (
    "cadence.pickling._reconstructors_data._make_storage",
    "cadence.pickling._reconstructors_data._make_tensor",
    "torch._utils._rebuild_parameter",
    *(f"torch.{d}" for d in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32",
        "uint64", "float16", "bfloat16", "float32", "float64", "complex64",
        "complex128", "float8_e4m3fn", "float8_e5m2",
    )),
)  # fmt: skip
# Names cadence itself vouches for, though their modules are on the deny list
# (copyreg, cadence.pickling): they build data only.
_VOUCHED = _DATA_GLOBALS | frozenset(_NUMPY) | frozenset(_TORCH)


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


def _refuse_unsafe(modules: tuple[str, ...], names: tuple[str, ...], allow_dangerous: bool) -> None:
    """Raise `UnsafeAllowlistError` naming every entry the deny list refuses."""
    refused: list[str] = []
    lines: list[str] = []
    for m in modules:
        found = dangerous_pattern(m)
        if found is None:
            continue
        module, danger = found
        if danger.never_whole:
            lines.append(
                f"Allowlist(modules=...) may not admit {m!r} as a whole ({module}: "
                f"{danger.why}), not even with allow_dangerous=True; list the globals you "
                "need in Allowlist(globals=[...]) instead"
            )
        elif not allow_dangerous:
            lines.append(
                f"Allowlist(modules=...) refused {m!r} ({module}: {danger.why}); list the "
                "globals you need in Allowlist(globals=[...]), or pass "
                f"allow_dangerous=True if every payload is trusted to call all of {m!r}"
            )
        else:
            continue
        refused.append(m)
    for g in () if allow_dangerous else names:
        found = dangerous_global(g)
        if found is None or g in _VOUCHED:
            continue
        module, danger = found
        lines.append(
            f"Allowlist(globals=...) refused {g!r} ({module}: {danger.why}); pass "
            "allow_dangerous=True only if every payload that may name it is trusted to "
            "call it"
        )
        refused.append(g)
    if len(lines) == 1:
        raise UnsafeAllowlistError(lines[0], tuple(refused))
    if lines:
        listed = "".join(f"\n  - {line}" for line in lines)
        raise UnsafeAllowlistError(
            f"Allowlist refused {len(lines)} entries:{listed}", tuple(refused)
        )


@dataclasses.dataclass(frozen=True)
class Allowlist:
    """The globals a restricted load may resolve.

    ``modules``: ``"pkg.mod"`` admits the classes and functions defined in that module;
    ``"pkg.*"`` admits those of ``pkg`` and all its submodules. ``globals``: exact
    ``"module.qualname"`` names. ``data`` (default True) admits built-in value types,
    the standard containers and cadence's dict-view and memoryview reconstructors.

    A global reached through an allowed module must be a class or a function *defined*
    in an allowed module (its ``__module__``), so neither ``mypkg.os.system``, nor a
    ``system`` that ``mypkg`` imported from ``os``, nor an object ``mypkg`` holds slips
    through an allowed ``mypkg``; modules themselves are never returned. See
    [Note: dotted names walk through classes only].

    Patterns and names that cover cadence's reconstructors or a module known to run
    code, load pickles, start processes or change files raise `UnsafeAllowlistError`
    here, before any payload is read; ``allow_dangerous=True`` admits the latter (never
    ``builtins``, ``os``, ``sys``, ``subprocess`` or ``cadence.pickling`` as a whole).
    """

    modules: tuple[str, ...] = ()
    globals: tuple[str, ...] = ()
    data: bool = True
    allow_dangerous: bool = False

    NUMPY = _NUMPY
    TORCH = _TORCH

    def __post_init__(self) -> None:
        modules = _as_names(self.modules, "modules")
        names = _as_names(self.globals, "globals")
        for field in ("data", "allow_dangerous"):
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise TypeError(f"Allowlist({field}=...) must be True or False, got {value!r}")
        _refuse_unsafe(modules, names, self.allow_dangerous)
        object.__setattr__(self, "modules", modules)
        object.__setattr__(self, "globals", names)

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


# ---------------------------------------------------------------------------------------
# Resolving a global
# ---------------------------------------------------------------------------------------

_WALK_FIX = (
    "No pickler writes such a name for data; name the class or function by its own "
    "module and qualified name"
)


def _refused(full: str, why: str, fix: str = "") -> ForbiddenGlobalError:
    fix = fix or (
        f"Allow it with Allowlist(globals=[{full!r}]) only if every payload that may name "
        "it is trusted to call it"
    )
    return ForbiddenGlobalError(f"refused to load the global {full!r}: {why}. {fix}", full)


def _kind(obj: Any) -> str:
    if isinstance(obj, types.ModuleType):
        return "module"
    if isinstance(obj, type):
        return "class"
    if isinstance(obj, types.FunctionType):
        return "function"
    return type(obj).__qualname__


def _not_defined_here(allow: Allowlist, obj: Any) -> str:
    """Why no allowed module defines ``obj`` ("" when one does)."""
    defined_in = getattr(obj, "__module__", None)
    if not isinstance(defined_in, str):
        return f"its __module__ is {defined_in!r}, so no allowed module defines it"
    if not allow._module_allowed(defined_in):
        return f"it is defined in {defined_in!r}, which is not allowed"
    return ""


def _not_admitted(allow: Allowlist, obj: Any, dotted: bool) -> str:
    """Why an allowed module's ``obj`` is refused ("" when it is admitted)."""
    if dotted and not isinstance(obj, type):
        return f"it is a {_kind(obj)}, and a dotted name may only name a class nested in classes"
    owner = getattr(obj, "__self__", None)
    if isinstance(obj, types.BuiltinFunctionType) and not isinstance(
        owner, (types.ModuleType, type(None))
    ):
        return (
            f"it is a method bound to a {type(owner).__qualname__} (its __module__ is "
            f"{obj.__module__!r})"
        )
    if not isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
        return (
            f"it is a {_kind(obj)}, not a class or function: an object a module holds is "
            "shared by the whole process"
        )
    return _not_defined_here(allow, obj)


def _through_module(allow: Allowlist, module: types.ModuleType, rest: list[str], where: str) -> str:
    why = f"it walks through the module {where!r}, and a dotted name may only walk through classes"
    # Look the rest up in module namespaces only (no attribute hooks run), to name
    # where the object it leads to is really defined.
    target: Any = module
    for part in rest:
        if not isinstance(target, types.ModuleType):
            return why
        target = vars(target).get(part)
    elsewhere = _not_defined_here(allow, target) if target is not None else ""
    return f"{elsewhere} (reached through the module {where!r})" if elsewhere else why


def _resolve(allow: Allowlist, module: str, name: str) -> Any:
    """The object ``module.name`` names, if the allowlist admits every step to it."""
    full = f"{module}.{name}"
    exact = allow._name_allowed(full)
    if not exact and not allow._module_allowed(module):
        raise _refused(full, "neither it nor its module is in the allowlist")
    parts = name.split(".")
    if not all(parts) or not all(module.split(".")):
        raise _refused(full, "it is not a dotted name", _WALK_FIX)
    __import__(module, level=0)
    obj = getattr(sys.modules[module], parts[0])
    for i, part in enumerate(parts[1:], 1):
        where = ".".join((module, *parts[:i]))
        if isinstance(obj, types.ModuleType):
            raise _refused(full, _through_module(allow, obj, parts[i:], where), _WALK_FIX)
        if not isinstance(obj, type):
            why = f"{where!r} is a {_kind(obj)}, and a dotted name may only walk through classes"
            raise _refused(full, why, _WALK_FIX)
        if exact:
            obj = getattr(obj, part)
            continue
        why = _not_defined_here(allow, obj)
        if why:
            raise _refused(full, f"it walks through {where!r}: {why}")
        # The class's own namespace: no descriptor or metaclass hook runs on the way.
        try:
            obj = vars(obj)[part]
        except KeyError:
            raise AttributeError(f"class {where!r} defines no attribute {part!r}") from None
    if isinstance(obj, types.ModuleType):
        raise _refused(full, "it is a module (a payload could rewrite the module's globals)")
    if not exact:
        why = _not_admitted(allow, obj, dotted=len(parts) > 1)
        if why:
            raise _refused(full, why)
    return obj


class RestrictedUnpickler(pickle._Unpickler):
    """An unpickler whose ``find_class`` admits only an `Allowlist`.

    Safe for payloads from peers you do not fully trust, to the extent that the allowed
    globals are (see the module docs); refusals raise `ForbiddenGlobalError` naming the
    global. It is the standard library's pure-Python unpickler (``pickle._Unpickler``)
    with guarded opcodes, not a ``pickle.Unpickler`` subclass: see
    [Note: why restricted loads run the pure-Python unpickler]. Python 2 module renames
    are not applied, so names are checked as written. A subclass that overrides
    ``find_class`` should call ``super().find_class``.
    """

    dispatch = guarded_dispatch()

    def __init__(self, file: Any, allow: Allowlist, **kwargs: Any) -> None:
        if not isinstance(allow, Allowlist):
            raise TypeError(
                f"allow= takes a cadence.pickling.Allowlist, got {type(allow).__name__}; "
                "write Allowlist(modules=[...], globals=[...])"
            )
        kwargs.setdefault("fix_imports", False)
        super().__init__(ChunkedReader(file), **kwargs)
        self._allow = allow
        # Every object a global named in this load, by id (and kept alive, so ids stay
        # unique): the guarded opcodes refuse to change them.
        self._globals: dict[int, tuple[Any, str]] = {}

    def find_class(self, module: str, name: str) -> Any:
        sys.audit("pickle.find_class", module, name)
        obj = _resolve(self._allow, module, name)
        self._globals[id(obj)] = (obj, f"{module}.{name}")
        return obj

    def get_extension(self, code: int) -> None:
        # The standard unpicklers answer an extension code from copyreg's process-wide
        # cache first, which any earlier load fills: a global an unrestricted load
        # resolved would come back here unchecked. Resolve the registered name each time.
        key = copyreg._inverted_registry.get(code)  # type: ignore[attr-defined]  # copyreg's private cache is not in typeshed
        if not key:
            raise MalformedPayloadError(
                f"unregistered extension code {code}: the payload was made in a process "
                "that registered it with copyreg.add_extension; register it here too"
            )
        # pickle._Unpickler.load binds self.append (the stack's) before any opcode runs.
        self.append(self.find_class(*key))  # type: ignore[attr-defined]  # bound by pickle._Unpickler.load


def loads_restricted(data: bytes, allow: Allowlist, *, buffers: Iterable[Any] | None = None) -> Any:
    """Load ``data`` resolving only the globals ``allow`` admits.

    Raises `ForbiddenGlobalError` (an ``UnpicklingError``) naming the first refused
    global, or the first object the payload tried to change without having created it;
    `MalformedPayloadError` for bytes that are cut short or not a pickle. ``buffers`` are
    the out-of-band buffers, as for ``pickle.loads``.
    """
    return RestrictedUnpickler(io.BytesIO(data), allow, buffers=buffers).load()


def load_restricted(file: Any, allow: Allowlist, *, buffers: Iterable[Any] | None = None) -> Any:
    """Load one pickle from the binary file ``file``; see :func:`loads_restricted`."""
    return RestrictedUnpickler(file, allow, buffers=buffers).load()
