"""The modules an `Allowlist` refuses to admit: they run code, load pickles, start
processes or change files when a payload calls what they hold.

[Note: the deny list guards against mistakes; the allowlist is the boundary]
A restricted load resolves only what the allowlist names, so this list does not make a
load safe; it stops an allowlist from naming, by accident or by a wildcard, a callable
that hands a payload the whole process: ``builtins.eval``, ``os.system``,
``pickle.loads`` (an unrestricted load inside the restricted one), ``importlib`` (import
and so run any module), ``operator.attrgetter`` (reach any attribute), or cadence's own
reconstructors (rebuild a function from the payload's bytecode). It is curated, not
complete: allowing a module still vouches for everything defined in it.

Each entry either covers a module and its submodules as a whole, or (``names``) only
some names of a module that also holds harmless ones (``builtins.set`` is data,
``builtins.eval`` is not; numpy re-exports ``numpy.load`` under ``numpy`` itself, so
``Allowlist(modules=["numpy"])`` would admit it). ``never_whole`` entries are refused as
module patterns even with ``allow_dangerous=True``: admitting one of them as a whole
leaves nothing restricted.
"""

from __future__ import annotations

import dataclasses

# Everything not listed here is private to cadence.pickling.
__all__ = ["Danger", "dangerous_global", "dangerous_pattern"]


@dataclasses.dataclass(frozen=True)
class Danger:
    why: str
    names: frozenset[str] | None = None  # None: every name of the module and its submodules
    never_whole: bool = False


def _names(names: str) -> frozenset[str]:
    return frozenset(names.split())


_RUN_PROGRAMS = "runs programs and changes files (system, exec*, spawn*, fork, remove, open)"
_LOAD_PICKLES = "loads pickles without any restriction"
_RUN_SOURCE = "compiles and runs code given as a string"

_DANGEROUS: dict[str, Danger] = {
    # Run arbitrary code, reach any object, or start programs: admitting any of these
    # as a whole leaves a restricted load unrestricted.
    "builtins": Danger(
        "eval, exec, compile, __import__, getattr and setattr run code or reach any "
        "object; open and input touch files and the terminal; type builds classes",
        names=_names(
            "__build_class__ __import__ breakpoint compile delattr eval exec exit "
            "getattr globals help input locals open quit setattr type vars"
        ),
        never_whole=True,
    ),
    "os": Danger(_RUN_PROGRAMS, never_whole=True),
    "posix": Danger(_RUN_PROGRAMS, never_whole=True),
    "nt": Danger(_RUN_PROGRAMS, never_whole=True),
    "sys": Danger(
        "modules, settrace, setprofile and breakpointhook reach any object or run code "
        "on every call",
        never_whole=True,
    ),
    "subprocess": Danger("runs programs", never_whole=True),
    "cadence.pickling": Danger(
        "its reconstructors rebuild functions from the payload's bytecode, and its "
        "loads and load unpickle without any restriction",
        never_whole=True,
    ),
    # Build or run code.
    "types": Danger("FunctionType and CodeType build functions from bytecode"),
    "marshal": Danger("loads builds code objects from bytes"),
    "code": Danger(_RUN_SOURCE),
    "codeop": Danger(_RUN_SOURCE),
    "runpy": Danger("runs modules and files"),
    "importlib": Danger("import_module imports, and so runs, any module"),
    "pkgutil": Danger("resolve_name imports any module and reaches any attribute"),
    "zipimport": Danger("imports code from archives"),
    "pydoc": Danger("locate imports any module; its pager runs a shell command"),
    "pdb": Danger(_RUN_SOURCE),
    "bdb": Danger(_RUN_SOURCE),
    "timeit": Danger(_RUN_SOURCE),
    "trace": Danger(_RUN_SOURCE),
    "profile": Danger(_RUN_SOURCE),
    "cProfile": Danger(_RUN_SOURCE),
    "doctest": Danger("runs the code in docstrings"),
    "typing": Danger("get_type_hints evaluates strings as code"),
    "dataclasses": Danger("make_dataclass and dataclass generate code and exec it"),
    "ctypes": Danger("calls native functions and writes raw memory"),
    "_ctypes": Danger("calls native functions and writes raw memory"),
    "gc": Danger("get_objects and get_referrers reach every object in the process"),
    # Gadgets: call any callable, or reach any attribute, a payload hands them.
    "functools": Danger("partial and reduce call whatever callable they are given"),
    "operator": Danger("attrgetter, methodcaller and getitem reach any attribute or method"),
    "_operator": Danger("attrgetter, methodcaller and getitem reach any attribute or method"),
    "copyreg": Danger("add_extension and pickle change how every later pickle loads and dumps"),
    # Load pickles (an unrestricted load inside the restricted one).
    "pickle": Danger(_LOAD_PICKLES),
    "_pickle": Danger(_LOAD_PICKLES),
    "shelve": Danger(_LOAD_PICKLES),
    "dill": Danger(_LOAD_PICKLES),
    "cloudpickle": Danger(_LOAD_PICKLES),
    "joblib": Danger(_LOAD_PICKLES),
    "multiprocessing": Danger("starts processes and unpickles what they send"),
    "numpy": Danger(
        "load unpickles (allow_pickle=True); save, savez, savetxt and memmap write files",
        names=_names("fromfile genfromtxt load loadtxt memmap save savetxt savez savez_compressed"),
    ),
    "numpy.lib": Danger("npyio and format load pickles and write files"),
    "numpy.f2py": Danger("compiles and runs programs"),
    "numpy.distutils": Danger("compiles and runs programs"),
    "numpy.testing": Danger("runs programs and code given as a string"),
    "numpy.ctypeslib": Danger("loads native libraries"),
    "torch": Danger(
        "load unpickles; save and from_file write and map files; compile generates code",
        names=_names("compile from_file load save"),
    ),
    "torch.serialization": Danger(_LOAD_PICKLES),
    "torch.hub": Danger("downloads and runs code"),
    "torch.package": Danger("loads pickles and the code packaged with them"),
    "torch.jit": Danger("loads and compiles code"),
    "torch.utils.cpp_extension": Danger("compiles and loads native code"),
    "torch._C": Danger("holds torch's native loaders and compilers"),
    "torch.multiprocessing": Danger("starts processes and unpickles what they send"),
    "torch.distributed": Danger("unpickles objects peers send and runs remote calls"),
    "torch._dynamo": Danger("generates and runs code"),
    "torch._inductor": Danger("generates, compiles and runs code"),
    "pandas": Danger(
        "read_pickle unpickles; eval evaluates expressions", names=_names("eval read_pickle")
    ),
    "pandas.io": Danger("reads pickles and files"),
    "pandas.core.computation": Danger("evaluates expressions"),
    # Start processes, change files, open connections.
    "pty": Danger("runs programs"),
    "asyncio": Danger("create_subprocess_exec and create_subprocess_shell run programs"),
    "shutil": Danger("rmtree, move, copy and unpack_archive change files"),
    "io": Danger("open and FileIO open files for writing", names=_names("FileIO open open_code")),
    "_io": Danger("open and FileIO open files for writing", names=_names("FileIO open open_code")),
    "socket": Danger("opens network connections"),
    "webbrowser": Danger("starts programs"),
    "logging": Danger(
        "config.listen runs configuration received from a socket, "
        "dictConfig instantiates any class by name, handlers open files"
    ),
    # cadence itself: its launcher and worker start processes and unpickle what they
    # run, checkpoints and compiled artifacts are pickles. The package as a whole (or
    # ``cadence.*``) covers cadence.pickling, so it is refused as cadence.pickling is.
    "cadence": Danger(
        "cadence.launch starts processes, cadence.init joins a process group, and the "
        "package holds cadence.pickling",
        names=_names("init launch"),
        never_whole=True,
    ),
    "cadence.launch": Danger("starts processes and unpickles what they return"),
    "cadence._worker": Danger("unpickles and runs the function it is sent"),
    "cadence.train.checkpoint": Danger(_LOAD_PICKLES),
    "cadence.precompiling": Danger("loads compiled artifacts with pickle and runs compilers"),
    "cadence.bench": Danger("runs benchmarks that exec generated code"),
    "cadence.cli": Danger("runs commands"),
    "cadence.__main__": Danger("runs commands"),
}


def _under(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def dangerous_pattern(pattern: str) -> tuple[str, Danger] | None:
    """A dangerous module an ``Allowlist(modules=[pattern])`` would cover, if any.

    A ``never_whole`` one first, so a pattern that covers one is always refused.
    """
    wildcard = pattern.endswith(".*")
    base = pattern[:-2] if wildcard else pattern
    found: list[tuple[str, Danger]] = []
    for module, danger in _DANGEROUS.items():
        covers = base == module or (wildcard and _under(module, base))
        if covers or (danger.names is None and _under(base, module)):
            found.append((module, danger))
    found.sort(key=lambda entry: not entry[1].never_whole)
    return found[0] if found else None


def dangerous_global(full: str) -> tuple[str, Danger] | None:
    """The dangerous module an ``Allowlist(globals=[full])`` name belongs to, if any."""
    for module, danger in _DANGEROUS.items():
        if not full.startswith(module + "."):
            continue
        first = full[len(module) + 1 :].split(".", 1)[0]
        if danger.names is None or first in danger.names:
            return module, danger
    return None
