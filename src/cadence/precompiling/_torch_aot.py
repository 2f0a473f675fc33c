"""Every use of torch's compiler internals in cadence, behind one feature test.

The rest of `cadence.precompile` talks to torch only through the functions here:
`aot_compile`, `serialize`, `deserialize`, `guard_ok`, `guard_failures`, `call`,
`runtime_captures`, `traced_sources` and the environment probes at the bottom.

[Note: precompile serializer paths]
torch's AOT entry points are public: ``torch.compile(fn, fullgraph=True).aot_compile(
(args, kwargs))`` returns an ``AOTCompiledFunction``, ``type(aot).serialize(aot)`` turns it
into bytes and ``torch.compiler.load_compiled_function(file)`` loads them. Its pickler
sends ``__main__`` helpers and classes by reference and rebuilds nested functions over the
loading module's globals, so a rank started by `cadence.launch` (whose ``__main__`` is not
the user's script) cannot load an artifact that names the user's model class, and in such
a rank ``aot_compile`` itself fails while pickling the guards. Two paths therefore exist:

* ``"cadence"``: the guards are pickled (at compile time, by ``pickle_guards_state``,
  which is swapped for the duration of the compile) by a pickler that lets torch reduce
  what it knows (tensors to meta tensors, modules, sympy functions, ops, pruned values)
  and `cadence.pickling` everything else (functions, cells, classes, instances of local
  classes) by value. The artifact's Python side is pickled by a re-implementation of
  ``AOTCompiledFunction.serialize`` over a `cadence.pickling.Pickler`. Loading is torch's
  own ``load_compiled_function``: both payloads load with a plain unpickler.
* ``"torch"``: torch's own ``serialize`` and ``load_compiled_function``, untouched. It
  loads in a process that runs the same script (a torchrun rank) for most shapes, and it
  is what later torch releases improve upstream.

Which torch versions take which path: the ``"cadence"`` path needs the internals to have
one of the two shapes it knows (the field names of ``CompileArtifacts`` and
``GraphRuntimeEnv``, ``serialize_guards`` calling the module-level ``pickle_guards_state``
and ``raise_local_type_error``, the ``GuardsStatePickler`` constructor of torch 2.13 or
of torch 2.15). `_feature_test` checks exactly that at import; torch 2.13, 2.14 and 2.15
pass (each verified by the precompile tests). What torch 2.15 changed, and what the
path does about it: its guard pickler takes the containers an EQUALS_MATCH guard reads
whole (passed on), swaps pruned lists and dicts for a persistent id that its unpickler
turns back into ``_Missing`` (delegated to torch's pickler), keeps constants the
compiler shares out of the pruned set (torch's rule used), and its loader checks a
magic header before the pickle (written by `payload_header`); its artifacts record an
inlined frame's unnamed scope, live builtins dict included (swapped for torch's stand-in,
as torch's own ``serialize`` does). Any other shape selects
``"torch"``, as do older releases, whose ``serialize`` returned bytes and whose pickler
took only a buffer. Setting ``CADENCE_PRECOMPILE_SERIALIZER=torch`` forces the fallback
(for comparisons).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import io
import os
import shutil
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch

from cadence import pickling
from cadence.precompiling._capture import class_digest, resolves_by_name

__all__ = [
    "SERIALIZER",
    "SERIALIZER_REASON",
    "aot_compile",
    "call",
    "compiler_config_digest",
    "cpp_kernel_keys",
    "cxx_identity",
    "deserialize",
    "guard_failures",
    "guard_ok",
    "inductor_cache_dir",
    "payload_header",
    "prepare",
    "runtime_captures",
    "serialize",
    "serializer",
    "traced_sources",
]

_ARTIFACT_FIELDS = {
    "signature",
    "guard_manager",
    "guards_state",
    "backend_id",
    "compiled_fn",
    "original_code",
    "runtime_env",
    "source_info",
    "device_type",
    "backend_name",
    "system_info",
}
_RUNTIME_ENV_FIELDS = {"bytecode", "closure", "used_globals", "argdefs", "kwdefaults"}
# The guard pickler's constructor after ``self``: torch 2.13's, then torch 2.15's (which
# also takes the tuples an EQUALS_MATCH guard reads whole, and rebases both picklers on
# ``FunctionPicklerBase``). Any other shape selects the ``"torch"`` path.
_GUARDS_PICKLER_INITS = (
    ["guard_tree_values", "empty_values", "missing_values", "args", "kwargs"],
    [
        "guard_tree_values",
        "empty_values",
        "missing_values",
        "value_guarded_containers",
        "args",
        "kwargs",
    ],
)


def _feature_test() -> str | None:
    """None when the internals have the shape the ``"cadence"`` path relies on, else why not."""
    try:
        from torch._dynamo import aot_compile as aot_mod
        from torch._dynamo import convert_frame, guards, package

        artifacts = {f.name for f in dataclasses.fields(aot_mod.CompileArtifacts)}
        if artifacts != _ARTIFACT_FIELDS:
            return f"CompileArtifacts fields changed: {sorted(artifacts ^ _ARTIFACT_FIELDS)}"
        env = {f.name for f in dataclasses.fields(convert_frame.GraphRuntimeEnv)}
        if not env >= _RUNTIME_ENV_FIELDS:
            return f"GraphRuntimeEnv lacks {sorted(_RUNTIME_ENV_FIELDS - env)}"
        for name in ("serialize", "guard_check", "prepare_f_locals", "disable_guard_check"):
            if not hasattr(aot_mod.AOTCompiledFunction, name):
                return f"AOTCompiledFunction has no {name}"
        if not hasattr(package.SerializedCode, "from_code_object"):
            return "SerializedCode.from_code_object is missing"
        if list(inspect.signature(guards.pickle_guards_state).parameters) != ["state", "builder"]:
            return "pickle_guards_state(state, builder) changed its signature"
        init = list(inspect.signature(guards.GuardsStatePickler.__init__).parameters)
        if init[1:] not in _GUARDS_PICKLER_INITS:
            return f"GuardsStatePickler.__init__{tuple(init)} changed"
        magic = getattr(aot_mod, "_AOT_COMPILE_MAGIC", None)
        if magic is not None and not isinstance(
            getattr(aot_mod, "_AOT_COMPILE_FORMAT_VERSION", None), int
        ):
            return "the artifact header (_AOT_COMPILE_MAGIC) has no format version"
        names = guards.CheckFunctionManager.serialize_guards.__code__.co_names
        if "pickle_guards_state" not in names or "raise_local_type_error" not in names:
            return "serialize_guards no longer calls the module-level guard pickler"
        for name in ("make_guard_filter_entry", "raise_local_type_error"):
            if not hasattr(guards, name):
                return f"torch._dynamo.guards.{name} is missing"
        if not hasattr(torch.compiler, "keep_portable_guards_unsafe"):
            return "torch.compiler.keep_portable_guards_unsafe is missing"
        load = inspect.signature(torch.compiler.load_compiled_function).parameters
        if "f_globals" not in load:
            return "load_compiled_function takes no f_globals"
    except Exception as exc:  # any import or introspection failure selects the fallback
        return f"{type(exc).__name__}: {exc}"
    return None


SERIALIZER_REASON = _feature_test()
SERIALIZER = "cadence" if SERIALIZER_REASON is None else "torch"


def serializer() -> str:
    """The path used now: ``"torch"`` when forced by the environment, else `SERIALIZER`."""
    if os.environ.get("CADENCE_PRECOMPILE_SERIALIZER", "").lower() == "torch":
        return "torch"
    return SERIALIZER


# ---------------------------------------------------------------------------------------
# Pickling: cadence.pickling under torch's reducers
# ---------------------------------------------------------------------------------------


def _class_method_reduce(obj: Any) -> Any:
    """A bound classmethod of an importable class goes by reference.

    cadence.pickling sends ``Cls.method`` (a bound method whose receiver is the class) by
    value, function included; the standard pickler writes ``getattr(Cls, "method")``.
    torch's reducers return such methods (``GuardsStatePickler._unpickle_tensor``,
    ``deserialize_compile_artifacts``) as reconstructors, and copying torch's code into
    the payload would freeze it, so they are written by reference here.
    """
    if isinstance(obj, types.MethodType) and isinstance(obj.__self__, type):
        owner = obj.__self__
        name = obj.__func__.__name__
        if resolves_by_name(owner) and getattr(owner, name, None) == obj:
            return getattr, (owner, name)
    return NotImplemented


def _main_class_reduce(obj: Any) -> Any:
    """A class defined in ``__main__``, resolved at load by name if the code matches.

    In a process running the same script (a torchrun rank, a cache load), the loaded
    artifact must refer to *that* process's class: the guards compare the model's class
    by identity. In a `cadence.launch` rank, ``__main__`` is cadence's worker and the class
    arrived by value; it is rebuilt by value, and its tracker id maps it onto the copy
    the rank already holds. The code digest keeps a same-named but different class from
    being picked up (its guard would then accept a model whose forward was never traced).
    """
    if (
        isinstance(obj, type)
        and obj.__module__ == "__main__"
        and "<locals>" not in obj.__qualname__
    ):
        return _resolve_main_class, (obj.__qualname__, class_digest(obj), pickling.dumps(obj))
    return NotImplemented


def _resolve_main_class(qualname: str, digest: str, payload: bytes) -> type:
    target: Any = sys.modules.get("__main__")
    try:
        for part in qualname.split("."):
            target = getattr(target, part)
    except AttributeError:
        target = None
    if isinstance(target, type) and class_digest(target) == digest:
        return target
    return pickling.loads(payload)  # type: ignore[no-any-return]  # loads is typed Any; the payload is a pickled class


class _ArtifactPickler(pickling.Pickler):
    """The Python side of an artifact: cadence by value, with the two rules above."""

    def reducer_override(self, obj: Any) -> Any:
        for rule in (_class_method_reduce, _main_class_reduce):
            rv = rule(obj)
            if rv is not NotImplemented:
                return rv
        return super().reducer_override(obj)


class _GuardsPickler(_ArtifactPickler):
    """torch's guard reducers first, cadence for what they leave to default pickling."""

    def __init__(self, torch_pickler: Any, file: Any) -> None:
        # torch 2.15 swaps pruned mutable containers for a persistent id (the C pickler
        # saves an exact list or dict by type, before ``reducer_override``), and its
        # guards unpickler turns that id back into ``_Missing``. torch 2.13's pickler has
        # no such hook. Set before the C pickler's __init__, which looks it up there.
        own_id = getattr(torch_pickler, "persistent_id", None)
        if own_id is not None:
            # An instance attribute on purpose (see above); mypy sees a method there.
            self.persistent_id = own_id  # type: ignore[method-assign]  # an instance attribute on purpose
        self._torch = torch_pickler
        super().__init__(file)

    def reducer_override(self, obj: Any) -> Any:
        from torch._dynamo.exc import PackageError

        t = self._torch
        pruned = id(obj) in t.empty_values or id(obj) in t.missing_values
        if not pruned and isinstance(obj, (types.FunctionType, types.CellType)):
            # torch rebuilds nested functions over the loading module's globals, prunes
            # functions whose name resolves elsewhere and reads cells eagerly (an empty
            # cell fails); cadence carries all three by value. Classes go to torch first:
            # it maps FSDP's generated classes and local namedtuples onto live ones.
            return super().reducer_override(obj)
        try:
            rv = t.reducer_override(obj)
        except PackageError:  # an instance of a local class: cadence sends it by value
            rv = NotImplemented
        if rv is NotImplemented:
            return super().reducer_override(obj)
        if isinstance(obj, torch.Tensor) and obj.grad is not None and isinstance(rv, tuple):
            rv = _drop_unguarded_grad(t, obj, rv)
        return rv


def _drop_unguarded_grad(t: Any, tensor: torch.Tensor, rv: tuple[Any, ...]) -> tuple[Any, ...]:
    """A tensor's ``.grad`` that no guard reads is written as None, not as ``_Missing``.

    torch 2.13 records a guarded tensor's gradient with it; when the gradient is not in
    the guard tree it becomes ``_Missing``, and loading fails with "assigned grad expected
    to be a Tensor or None". Every step compiled after a first backward (parameters with
    ``.grad``) hit it.
    """
    reconstruct, args = rv[0], rv[1]
    if getattr(reconstruct, "__name__", "") != "_unpickle_tensor" or not args:
        return rv
    if args[-1] is tensor.grad and id(tensor.grad) not in t.guard_tree_values:
        return (reconstruct, (*args[:-1], None), *rv[2:])
    return rv


def _pickle_guards_state(state: Any, builder: Any) -> bytes:
    """Stands in for ``torch._dynamo.guards.pickle_guards_state`` during a compile.

    Same pruning as torch's: values of the local scope no guard reads become
    ``_Missing``; receivers of methods the guards do not read become empty instances;
    when every guard is portable, the global scope and key-order guards are dropped.
    """
    from torch._dynamo import guards
    from torch._dynamo.exc import PackageError
    from torch.utils import _pytree as pytree

    tree_values = builder.guard_tree_values
    empty_values: dict[int, Any] = {}
    missing_values: dict[int, Any] = {}
    # torch 2.15 keeps constants the compiler shares across a module (a folded tuple
    # may also sit in a guarded ``__defaults__``) out of the pruned set; 2.13 has no rule.
    shared_constant = getattr(guards, "_is_shared_constant", lambda _value: False)
    for leaf in pytree.tree_leaves(state.output_graph.local_scope):
        if inspect.ismethod(leaf):
            base = leaf.__self__
            if id(base) not in tree_values:
                try:
                    type(base).__new__(type(base))
                except Exception:
                    continue
                empty_values[id(base)] = base
        elif id(leaf) not in tree_values and not shared_constant(leaf):
            missing_values[id(leaf)] = leaf
    entries = [guards.make_guard_filter_entry(g, builder) for g in state.output_graph.guards]
    if all(torch.compiler.keep_portable_guards_unsafe(entries)):
        state.output_graph.guard_on_key_order = set()
        state.output_graph.global_scope = {}
    # torch 2.15's constructor also takes the containers an EQUALS_MATCH reads whole
    # (see _GUARDS_PICKLER_INITS); the feature test admitted exactly these two shapes.
    whole = getattr(builder, "value_guarded_containers", None)
    extra = () if whole is None else (whole,)
    torch_pickler = guards.GuardsStatePickler(
        tree_values, empty_values, missing_values, *extra, io.BytesIO()
    )
    buf = io.BytesIO()
    try:
        _GuardsPickler(torch_pickler, buf).dump(state)
    except AttributeError as exc:
        raise PackageError(str(exc)) from exc
    return buf.getvalue()


def _allow_local_types(obj: Any) -> None:
    """Stands in for ``raise_local_type_error``: cadence pickles local classes by value."""


_SWAP_LOCK = threading.Lock()


@contextlib.contextmanager
def _guard_pickling() -> Iterator[None]:
    from torch._dynamo import guards

    with _SWAP_LOCK:
        saved = guards.pickle_guards_state, guards.raise_local_type_error
        guards.pickle_guards_state = _pickle_guards_state
        guards.raise_local_type_error = _allow_local_types  # type: ignore[assignment]  # torch's is NoReturn; ours returns
        try:
            yield
        finally:
            guards.pickle_guards_state, guards.raise_local_type_error = saved


def _serialize_cadence(aot: Any) -> bytes:
    """``AOTCompiledFunction.serialize`` over a cadence pickler, minus the source text.

    torch embeds the full text of every module the trace entered (``SourceInfo``): it
    is never read at load, it leaks the user's script and it is most of the bytes, so
    only the module names, line ranges and checksums are kept.
    """
    from torch._dynamo import aot_compile as aot_mod
    from torch._dynamo.package import SerializedCode

    state = dict(aot._artifacts.__dict__)
    state["guard_manager"] = None
    env = state["runtime_env"]
    used_globals = env.used_globals
    unnamed = getattr(aot_mod, "_picklable_unnamed_scope", None)
    if unnamed is not None and used_globals:
        # torch 2.15 records an inlined frame's unnamed scope whole, live builtins dict
        # included; its stand-in loads as the live dict (see torch's serialize).
        prefix = getattr(aot_mod, "_UNNAMED_SCOPE_PREFIX", "___unnamed_scope")
        used_globals = {
            name: unnamed(value) if name.startswith(prefix) and isinstance(value, dict) else value
            for name, value in used_globals.items()
        }
    state["runtime_env"] = dataclasses.replace(
        env, bytecode=SerializedCode.from_code_object(env.bytecode), used_globals=used_globals
    )
    compiled = state["compiled_fn"]
    state["compiled_fn"] = (
        type(compiled).deserialize_compile_artifacts,
        type(compiled).serialize_compile_artifacts(compiled),
    )
    state["original_code"] = SerializedCode.from_code_object(state["original_code"])
    info = state["source_info"]
    with contextlib.suppress(Exception):
        state["source_info"] = dataclasses.replace(
            info,
            inlined_sources={dataclasses.replace(s, content="") for s in info.inlined_sources},
        )
    buf = io.BytesIO()
    buf.write(payload_header())
    _ArtifactPickler(buf).dump(state)
    return buf.getvalue()


def payload_header() -> bytes:
    """The bytes torch's loader expects before the pickle of an artifact.

    torch 2.15 checks a magic string and a format version outside the pickle, before
    unpickling anything; torch 2.13's payload is the bare pickle.
    """
    from torch._dynamo import aot_compile as aot_mod

    magic = getattr(aot_mod, "_AOT_COMPILE_MAGIC", None)
    if magic is None:
        return b""
    return bytes(magic) + bytes([aot_mod._AOT_COMPILE_FORMAT_VERSION])


# ---------------------------------------------------------------------------------------
# Compile, save, load, call
# ---------------------------------------------------------------------------------------


def aot_compile(
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    backend: str,
    dynamic: bool | None,
    mode: str | None,
    options: dict[str, Any] | None,
) -> Any:
    """Compile ``fn`` for these inputs, fullgraph; returns the compiled function object."""
    compiled = torch.compile(
        fn, fullgraph=True, backend=backend, dynamic=dynamic, mode=mode, options=options
    )
    entry = getattr(compiled, "aot_compile", None)
    if entry is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no ahead-of-time compile "
            "(torch.compile(...).aot_compile); precompile needs torch>=2.13"
        )
    ctx = _guard_pickling() if serializer() == "cadence" else contextlib.nullcontext()
    with ctx:
        return entry((tuple(args), dict(kwargs)))


def serialize(aot: Any) -> bytes:
    if serializer() == "cadence":
        return _serialize_cadence(aot)
    result = type(aot).serialize(aot)
    # torch 2.13 wraps the bytes in AOTCompileSaveResult; earlier releases returned them.
    return bytes(getattr(result, "serialized_data", result))


def deserialize(data: bytes) -> Any:
    aot = torch.compiler.load_compiled_function(io.BytesIO(data))
    # `call` runs after cadence's own check; never twice. torch annotates the loaded
    # function as a plain Callable, though it is an AOTCompiledFunction.
    aot.disable_guard_check()  # type: ignore[attr-defined]  # torch types it Callable (see above)
    return aot


def prepare(aot: Any) -> Any:
    """A freshly compiled function, made ready to be called like a loaded one."""
    aot.disable_guard_check()
    return aot


def guard_ok(aot: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return bool(aot.guard_check(*args, **kwargs))


def guard_failures(aot: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """The failed guards, as torch words them (first line of each, without source notes)."""
    try:
        f_locals = aot.prepare_f_locals(*args, **kwargs)
    except TypeError as exc:  # the call does not even bind to the signature
        return [f"signature: {exc}"]
    info = aot._artifacts.guard_manager.check_verbose(f_locals)
    parts = [str(p).split("  #")[0].strip() for p in getattr(info, "verbose_code_parts", [])]
    return parts or [str(info)]


def call(aot: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return aot(*args, **kwargs)


def runtime_captures(aot: Any) -> list[tuple[str, Any]]:
    """What an artifact carries by value besides the graph: ``(label, value)`` pairs."""
    env = aot._artifacts.runtime_env
    out: list[tuple[str, Any]] = []
    freevars = getattr(env.bytecode, "co_freevars", ())
    for name, cell in zip(freevars, env.closure or ()):
        with contextlib.suppress(ValueError):  # an empty cell carries nothing
            out.append((f"fn.__closure__ {name!r}", cell.cell_contents))
    for name, value in (env.used_globals or {}).items():
        out.append((f"global {name}", value))
    params = list(aot._artifacts.signature.parameters.values())
    positional = [p for p in params if p.default is not inspect.Parameter.empty]
    for param in positional:
        out.append((f"default of parameter {param.name!r}", param.default))
    return out


def traced_sources(aot: Any) -> list[dict[str, Any]]:
    """The modules and line ranges the trace entered, with torch's checksums."""
    info = aot._artifacts.source_info
    return sorted(
        (
            {"module": s.module, "lines": [s.firstlineno, s.lastlineno], "sha256": s.checksum}
            for s in getattr(info, "inlined_sources", ())
        ),
        key=lambda d: (d["module"], d["lines"]),
    )


# ---------------------------------------------------------------------------------------
# Environment probes
# ---------------------------------------------------------------------------------------


def inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return str(cache_dir())


def cpp_kernel_keys() -> set[str]:
    """Keys of the C++ libraries inductor built or loaded in this process.

    A key names its files: ``<cache dir>/<key[1:3]>/<key>*.so`` (and ``.o`` for two-step
    builds). inductor skips the C++ build of a kernel whose library already exists, so
    shipping these files lets a cold node load an artifact without running g++.
    """
    try:
        from torch._inductor import codecache
    except Exception:
        return set()
    keys: set[str] = set()
    for name in ("CppCodeCache", "CppPythonBindingsCodeCache", "CppWrapperCodeCache"):
        cache = getattr(getattr(codecache, name, None), "cache", None)
        if isinstance(cache, dict):
            keys.update(k for k in cache if isinstance(k, str))
    return keys


@functools.cache
def cxx_identity() -> str:
    """The C++ compiler inductor runs on CPU, and the first line of its ``--version``."""
    try:
        from torch._inductor import config

        cxx = config.cpp.cxx
        names = [c for c in (cxx if isinstance(cxx, tuple) else (cxx,)) if c]
    except Exception:
        names = ["g++"]
    for name in names:
        path = shutil.which(str(name))
        if path is None:
            continue
        try:
            out = subprocess.run(
                [path, "--version"], capture_output=True, text=True, timeout=30, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        first = out.splitlines()[0] if out else ""
        return f"{os.path.realpath(path)}: {first}"
    return "none"


def compiler_config_digest() -> str:
    """A digest of the dynamo and inductor configs (they change what a compile produces)."""
    h = hashlib.sha256()
    for module in (torch._dynamo.config, torch._inductor.config):
        try:
            portable = module.save_config_portable()
        except Exception:
            portable = {}
        h.update(_stable_repr(portable).encode())
    return h.hexdigest()[:32]


def _stable_repr(value: Any) -> str:
    """``repr`` with sets and dicts in sorted order, so the digest is hash-seed independent."""
    if isinstance(value, dict):
        items = sorted((_stable_repr(k), _stable_repr(v)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_stable_repr(v) for v in value)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_stable_repr(v) for v in value) + "]"
    return repr(value)
