"""Which allowlists a restricted load accepts, decided when the Allowlist is built.

- A module pattern that covers cadence's own reconstructors (``cadence``, ``cadence.*``,
  ``cadence.pickling``, ``cadence.pickling.*``, a submodule) is refused, as the
  standard library's code-running modules are (``builtins``, ``os``, ``sys``,
  ``subprocess``): even with ``allow_dangerous=True``. So a cadence wildcard cannot
  rebuild and run a function by value.
- A pattern or an exact global that covers a module known to run code, load pickles,
  start processes or change files (``posix``, ``pickle``, ``importlib``, ``runpy``,
  ``shutil``, ``types``, ``operator``, ``functools``, ``marshal``, ``ctypes``, ``code``,
  ``numpy.load``, ``torch.load``, ...) is refused with `UnsafeAllowlistError`, a
  ``ValueError``, unless ``allow_dangerous=True``.
- The error names every refused entry, why, and the fix; ``.refused`` lists them.
- The presets, the default data, and ordinary patterns (``collections``,
  ``numpy.linalg``, ``cadence.topology``) are accepted.
- ``allow_dangerous`` takes True or False only.
"""

from __future__ import annotations

import operator

import pytest

from cadence import pickling
from cadence.pickling import Allowlist, UnsafeAllowlistError, loads_restricted
from tests.pickling import _payloads as p

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free


class _CallOnLoad:
    """Reduces to ``func()``: the payload calls ``func`` while it loads."""

    def __init__(self, func):
        self.func = func

    def __reduce__(self):
        return self.func, ()


@pytest.mark.parametrize(
    "pattern",
    ["cadence", "cadence.*", "cadence.pickling", "cadence.pickling.*",
     "cadence.pickling._reconstructors"],
)  # fmt: skip
def test_patterns_covering_cadence_s_reconstructors_are_refused(pattern):
    with pytest.raises(UnsafeAllowlistError, match="may not admit"):
        Allowlist(modules=[pattern])
    with pytest.raises(UnsafeAllowlistError, match="may not admit"):
        Allowlist(modules=[pattern], allow_dangerous=True)


def test_a_cadence_wildcard_cannot_run_a_function_by_value(tmp_path, protocol):
    marker = tmp_path / "ran"

    def touch():
        marker.touch()

    payload = pickling.dumps(_CallOnLoad(touch), protocol=protocol)
    with pytest.raises(UnsafeAllowlistError, match=r"'cadence\.\*'"):
        loads_restricted(payload, Allowlist(modules=["cadence.*"]))
    assert not p.ran_code(marker)


@pytest.mark.parametrize(
    "pattern",
    ["posix", "nt", "os", "os.*", "_pickle", "pickle", "importlib", "importlib.*",
     "importlib.util", "runpy", "shutil", "subprocess", "builtins", "code", "ctypes",
     "ctypes.*", "marshal", "sys", "types", "operator", "_operator", "functools", "pty",
     "numpy", "numpy.*", "torch", "torch.*", "torch.serialization", "pandas.*", "typing"],
)  # fmt: skip
def test_patterns_covering_code_running_modules_are_refused(pattern):
    with pytest.raises(UnsafeAllowlistError) as info:
        Allowlist(modules=[pattern])
    assert info.value.refused == (pattern,)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "name",
    ["builtins.eval", "builtins.exec", "builtins.getattr", "builtins.__import__",
     "builtins.open", "builtins.compile", "types.FunctionType", "types.CodeType",
     "operator.attrgetter", "operator.methodcaller", "functools.partial", "posix.system",
     "os.system", "_pickle.loads", "pickle.loads", "marshal.loads",
     "importlib.import_module", "runpy.run_path", "shutil.rmtree", "subprocess.Popen",
     "code.InteractiveInterpreter", "ctypes.CDLL", "sys.modules", "numpy.load",
     "torch.load", "torch.serialization.load", "copyreg.add_extension",
     "cadence.pickling._reconstructors._make_function", "cadence.pickling.loads",
     "cadence.launch"],
)  # fmt: skip
def test_globals_that_run_code_are_refused(name):
    with pytest.raises(UnsafeAllowlistError, match="allow_dangerous=True") as info:
        Allowlist(globals=[name])
    assert info.value.refused == (name,)


def test_the_error_names_every_refused_entry_and_the_fix():
    with pytest.raises(UnsafeAllowlistError) as info:
        Allowlist(modules=["myproject.configs", "pickle", "cadence.*"],
                  globals=["builtins.eval", "collections.OrderedDict"])  # fmt: skip
    message = str(info.value)
    assert info.value.refused == ("pickle", "cadence.*", "builtins.eval")
    for entry in ("'pickle'", "'cadence.*'", "'builtins.eval'"):
        assert entry in message
    assert "myproject" not in message and "OrderedDict" not in message
    assert "allow_dangerous=True" in message and "Allowlist(globals=[...])" in message


def test_allow_dangerous_admits_what_was_refused():
    allow = Allowlist(modules=["operator"], globals=["builtins.getattr"], allow_dangerous=True)
    assert loads_restricted(p.payload(p.stack_global("builtins", "getattr")), allow) is getattr
    got = loads_restricted(p.payload(p.stack_global("operator", "attrgetter")), allow)
    assert got is operator.attrgetter


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"data": False},
        {"globals": Allowlist.NUMPY + Allowlist.TORCH},
        {"modules": ["myproject.configs"], "globals": Allowlist.NUMPY},
        {"modules": ["collections", "collections.*", "datetime", "numpy.linalg",
                     "torch.nn.*", "cadence.topology", "tests.pickling.*"]},
        {"globals": ["builtins.set", "builtins.print", "copyreg._reconstructor",
                     "numpy.linalg.norm", "torch.float32", "cadence.topology.Coords",
                     "operators.attrgetter", "typingx.Any"]},
    ],
)  # fmt: skip
def test_ordinary_allowlists_are_accepted(kwargs):
    Allowlist(**kwargs)


def test_allow_dangerous_takes_a_bool():
    with pytest.raises(TypeError, match=r"allow_dangerous=\.\.\.\) must be True or False"):
        Allowlist(allow_dangerous="yes")  # type: ignore[arg-type]
