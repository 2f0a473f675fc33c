"""Reducers for code, cells, functions, bound methods and modules.

A reducer takes the dump state and one object and returns what ``__reduce__`` would: a
tuple ``(callable, args[, state, listitems, dictitems, state_setter])`` naming a
reconstructor, or ``NotImplemented`` to let the C pickler write the object its own way
(for a function or class: a ``GLOBAL`` opcode, by reference).

[Note: slot policy] A rebuilt function needs its code, closure, ``__defaults__`` and
``__kwdefaults__`` to be called correctly: those slots are *call-critical* and never
pruned; if one does not pickle, the dump fails and names the path. ``__dict__`` entries
(``__wrapped__`` included), ``__doc__``, each annotation and ``__type_params__`` (as a
whole) are *optional*: nothing needs them to call the function, so an entry that does
not pickle is dropped with a ``PrunedSlotWarning`` naming it. The error path walk
(``_paths``) marks exactly these edges as prunable.
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import Any

from cadence.pickling import _reconstructors, _reconstructors_data
from cadence.pickling._canonical import (
    SortedSet,
    canonical,
    canonical_dict,
    name,
    name_cache_generation,
    stable_sorted,
)
from cadence.pickling._lookup import (
    code_attribute_names,
    code_global_names,
    find_submodules,
    is_registered_by_value,
    lookup_by_reference,
)
from cadence.pickling._state import DumpState

# Everything not listed here is private to cadence.pickling.
__all__ = [
    "cell_reduce",
    "code_reduce",
    "function_getstate",
    "function_reduce",
    "method_reduce",
    "module_reduce",
]


def function_getstate(state: DumpState, func: types.FunctionType) -> dict[str, Any]:
    code = func.__code__
    pruned = state.pruned.get(id(func), ())
    # [Note: state keys] The keys start with "@" so that they are never interned: an
    # interned key would be the very object of a user string spelled the same (a function
    # named "closure"), and whether the pickler writes it or a memo reference would then
    # depend on string identity, which changes when a payload is reloaded and dumped again.
    out: dict[str, Any] = {}

    g = func.__globals__
    names = code_global_names(code)
    if names:
        gvals = {name(n): canonical(state, g[n]) for n in names if n in g and n != "__builtins__"}
        if gvals:
            out["@globals"] = gvals

    if func.__closure__:
        contents: dict[str, Any] = {}
        for var, cell in zip(code.co_freevars, func.__closure__):
            try:
                contents[name(var)] = canonical(state, cell.cell_contents)
            except ValueError:  # an empty cell stays empty (reading it raises NameError)
                pass
        if contents:
            out["@closure"] = contents

    # Modules read as globals or from cells may be reached as ``pkg.sub.attr``; name the
    # imported submodules so the loading process imports them too.
    mods = [v for v in (*out.get("@globals", {}).values(), *out.get("@closure", {}).values())
            if isinstance(v, types.ModuleType)]  # fmt: skip
    if mods:
        attrs = code_attribute_names(code)
        subs = [sub for m in mods for sub in find_submodules(m, attrs)]
        if subs:
            out["@submodules"] = subs

    if func.__dict__:
        # Keys through name() (see [Note: names in the payload]).
        d = {
            name(k) if type(k) is str else k: canonical(state, v)
            for k, v in func.__dict__.items()
            if ("__dict__", k) not in pruned
        }
        if d:
            out["@dict"] = d
    tp = getattr(func, "__type_params__", None)
    if tp and ("__type_params__",) not in pruned:
        out["@type_params"] = tp
    if func.__defaults__ is not None:
        out["@defaults"] = canonical(state, func.__defaults__)
    if func.__kwdefaults__ is not None:
        out["@kwdefaults"] = canonical_dict(state, func.__kwdefaults__)
    if ("__doc__",) in pruned:
        out["@doc"] = None
    elif not (code.co_consts and func.__doc__ is code.co_consts[0]):
        # A docstring the code holds is set again by FunctionType itself.
        out["@doc"] = func.__doc__
    ann = func.__annotations__
    if ann:
        out["@annotations"] = {k: v for k, v in ann.items() if ("__annotations__", k) not in pruned}
    # FunctionType takes __qualname__ from co_qualname (3.11+); carry it only when it was
    # reassigned, e.g. by functools.wraps. Older Pythons always carry it.
    if func.__qualname__ != getattr(code, "co_qualname", None):
        out["@qualname"] = _maybe_name(func.__qualname__)
    out["@module"] = _maybe_name(func.__module__)
    return out


def _maybe_name(value: Any) -> Any:
    return name(value) if type(value) is str else value


# [Note: code tuples] The compiler shares equal constant tuples between the code objects
# of one module (two methods with ``co_varnames == ("self",)`` may hold the very same
# tuple), but a loaded code object has tuples of its own. If the pickler wrote the
# original tuples, the first process would emit a memo reference where a process that
# loaded the class emits a second copy, and re-pickling a loaded class would give other
# bytes. So each name tuple is rebuilt here, from the private copies of the names (see
# [Note: names in the payload]), and so are the string constants.
def _names(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple([name(n) for n in names])


def _const(c: Any) -> Any:
    # CodeType interns string constants, also inside tuples and frozensets: copy them as
    # names. A frozenset constant (``x in {"a", "b"}``) is written sorted.
    t = type(c)
    if t is str:
        return name(c)
    if t is tuple:
        return tuple([_const(v) for v in c])
    if t is frozenset:
        return SortedSet(frozenset, stable_sorted(_const(v) for v in c))
    return c


if sys.version_info >= (3, 11):

    def _code_args(code: types.CodeType) -> tuple[Any, ...]:
        return (
            code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount,
            code.co_nlocals, code.co_stacksize, code.co_flags, code.co_code,
            tuple([_const(c) for c in code.co_consts]), _names(code.co_names),
            _names(code.co_varnames), name(code.co_filename), name(code.co_name),
            name(code.co_qualname), code.co_firstlineno, code.co_linetable,
            code.co_exceptiontable, _names(code.co_freevars), _names(code.co_cellvars),
        )  # fmt: skip

else:  # pragma: no cover - 3.10

    def _code_args(code: types.CodeType) -> tuple[Any, ...]:
        return (
            code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount,
            code.co_nlocals, code.co_stacksize, code.co_flags, code.co_code,
            tuple([_const(c) for c in code.co_consts]), _names(code.co_names),
            _names(code.co_varnames), name(code.co_filename), name(code.co_name),
            code.co_firstlineno, code.co_linetable, _names(code.co_freevars),
            _names(code.co_cellvars),
        )  # fmt: skip


_VERSION = tuple(sys.version_info[:2])
# Code objects are immutable, so their reduce arguments are computed once per code
# object, not once per dump: a payload of a thousand closures from one factory, or the
# same step function sent every iteration, pays for it once. Keyed by id with a weak
# reference that proves the id was not reused; tied to the generation of the name copies
# it holds (see [Note: names in the payload]).
_CODE_ARGS: dict[int, tuple[weakref.ref[types.CodeType], int, tuple[Any, ...]]] = {}
_CODE_ARGS_LIMIT = 4096


def code_reduce(state: DumpState, code: types.CodeType) -> tuple[Any, ...]:
    generation = name_cache_generation()
    hit = _CODE_ARGS.get(id(code))
    if hit is not None and hit[0]() is code and hit[1] == generation:
        return hit[2]
    rv = (_reconstructors._make_code, (_VERSION, _code_args(code)))
    if len(_CODE_ARGS) >= _CODE_ARGS_LIMIT:
        _CODE_ARGS.clear()
    _CODE_ARGS[id(code)] = (weakref.ref(code), generation, rv)
    return rv


def cell_reduce(state: DumpState, cell: types.CellType) -> tuple[Any, ...]:
    # A cell that belongs to a function being pickled travels empty: the function's state
    # fills it after the function is memoized, which is what makes a recursive closure
    # terminate. A cell reached on its own carries its contents as its own state.
    if id(cell) in state.closure_cells:
        return _reconstructors._make_cell, ()
    try:
        contents = cell.cell_contents
    except ValueError:
        return _reconstructors._make_cell, ()
    return (
        _reconstructors._make_cell,
        (),
        canonical(state, contents),
        None,
        None,
        _reconstructors._cell_setstate,
    )


def _globals_skeleton(state: DumpState, g: dict[str, Any]) -> dict[str, Any]:
    # One skeleton per distinct __globals__ per payload, so functions of one module share
    # one rebuilt dict. It travels as a reduce argument and holds only what relative
    # imports need; each function's referenced names arrive as that function's state,
    # after the function is memoized, so a function that reads itself as a global
    # (recursion, a registry dict holding it) terminates.
    base = state.globals_skeletons.get(id(g))
    if base is None:
        base = {"__name__": _maybe_name(g.get("__name__"))}
        if g.get("__package__") is not None:
            base["__package__"] = _maybe_name(g["__package__"])
        state.globals_skeletons[id(g)] = base
        state.keepalive.append(g)
    return base


# The reconstructors every payload names: known to go by reference, so the name walk is
# skipped for them (it would run for each one in every dump).
_RECONSTRUCTORS = frozenset(
    f
    for module in (_reconstructors, _reconstructors_data)
    for f in vars(module).values()
    if isinstance(f, types.FunctionType) and f.__module__ == module.__name__
)


def function_reduce(state: DumpState, func: types.FunctionType) -> Any:
    if func in _RECONSTRUCTORS or lookup_by_reference(func):
        return NotImplemented  # the C pickler writes a GLOBAL opcode
    closure = func.__closure__
    if closure:
        for cell in closure:
            state.closure_cells[id(cell)] = cell
    base = _globals_skeleton(state, func.__globals__)
    code = func.__code__
    # The name travels only when it differs from co_name (wraps renames): a second copy
    # of an equal string would be memoized or not depending on string identity, which
    # differs between the dumping process and one that reloaded the function.
    fname = None if func.__name__ == code.co_name else _maybe_name(func.__name__)
    return (
        _reconstructors._make_function,
        (code, base, fname, closure),
        function_getstate(state, func),
        None,
        None,
        _reconstructors._function_setstate,
    )


def method_reduce(state: DumpState, method: types.MethodType) -> Any:
    # Always (function, receiver): reading __func__ and __self__ runs no user code, and a
    # hand-built MethodType whose name does not resolve on the receiver, or a property
    # named like the method, still comes back as the same bound method.
    return types.MethodType, (method.__func__, method.__self__)


def module_reduce(state: DumpState, module: types.ModuleType) -> Any:
    modname = module.__name__
    if sys.modules.get(modname) is module and not is_registered_by_value(modname):
        return _reconstructors._import_module, (name(modname),)
    # A module that exists only here (made with types.ModuleType) or one registered by
    # value travels with its namespace, as the state of an empty module that is memoized
    # first (a function of the module that reads the module finds it in the memo).
    # ``__builtins__`` stays behind: some libraries put unpicklable objects in it, and
    # the loading side has builtins of its own.
    ns = {
        _maybe_name(k): canonical(state, v) for k, v in vars(module).items() if k != "__builtins__"
    }
    return (
        _reconstructors._make_dynamic_module,
        (name(modname),),
        ns,
        None,
        None,
        _reconstructors._module_setstate,
    )
