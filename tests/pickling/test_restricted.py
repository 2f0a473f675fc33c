"""Restricted loading: only the globals an Allowlist admits are resolved; every refusal
names the refused global, before anything is imported or called."""

from __future__ import annotations

import collections
import datetime
import decimal
import io
import os
import pickle

import pytest

from cadence import pickling
from cadence.pickling import Allowlist, ForbiddenGlobalError, loads_restricted
from tests.pickling.fixtures import fx_restricted

FX = "tests.pickling.fixtures.fx_restricted"


class _Reduce:
    """Reduces to ``func(*args)``: the shape of every code-running pickle."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _global(module: str, name: str, protocol: int) -> bytes:
    """A payload that only names ``module.name`` (what a hostile peer can write)."""
    if protocol >= 4:
        m, n = (s.encode() for s in (module, name))
        return (b"\x80\x04\x8c" + bytes([len(m)]) + m + b"\x8c" + bytes([len(n)]) + n
                + b"\x93.")  # fmt: skip
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n."


def test_plain_data_loads_with_the_default_allowlist(protocol):
    data = {
        "list": [1, 2.5, "x", b"y", None, True],
        "set": {1, 2},
        "frozen": frozenset({"a"}),
        "ordered": collections.OrderedDict(a=1),
        "counter": collections.Counter("aab"),
        "deque": collections.deque([1, 2]),
        "when": datetime.datetime(2024, 1, 2, 3, 4, 5),
        "money": decimal.Decimal("1.10"),
        "view": memoryview(b"abc"),
        "keys": {"k": 1}.keys(),
        "complex": 1 + 2j,
        "range": range(3),
        "bytearray": bytearray(b"z"),
    }
    loaded = loads_restricted(pickling.dumps(data, protocol=protocol), Allowlist())
    assert loaded["view"].tobytes() == b"abc" and list(loaded["keys"]) == ["k"]
    del loaded["view"], loaded["keys"], data["view"], data["keys"]
    assert loaded == data


def test_a_function_by_value_is_refused_naming_the_reconstructor(protocol):
    k = 3
    payload = pickling.dumps(lambda x: x + k, protocol=protocol)
    with pytest.raises(ForbiddenGlobalError, match=r"'cadence\.pickling\._reconstructors\._make_"
                       ) as info:  # fmt: skip
        loads_restricted(payload, Allowlist())
    assert info.value.global_name.startswith("cadence.pickling._reconstructors._make_")
    assert "Allowlist(globals=[" in str(info.value)


@pytest.mark.parametrize(
    ("func", "args", "refused"),
    [
        (eval, ("1 + 1",), "builtins.eval"),
        (os.system, ("true",), f"{os.system.__module__}.system"),
        (getattr, (object, "__subclasses__"), "builtins.getattr"),
        (__import__, ("os",), "builtins.__import__"),
    ],
)
def test_code_running_globals_are_refused_before_any_call(protocol, func, args, refused):
    payload = pickle.dumps(_Reduce(func, *args), protocol=protocol)
    with pytest.raises(ForbiddenGlobalError, match=f"'{refused}'") as info:
        loads_restricted(payload, Allowlist(modules=["collections"]))
    assert info.value.global_name == refused


def test_allowed_module_admits_its_own_classes_only(protocol):
    allow = Allowlist(modules=[FX])
    loaded = loads_restricted(pickling.dumps(fx_restricted.build(), protocol=protocol), allow)
    assert loaded == fx_restricted.Config(0.1)
    with pytest.raises(ForbiddenGlobalError, match=f"'{FX}.Config'.*neither it nor its module"):
        loads_restricted(pickling.dumps(fx_restricted.build(), protocol=protocol), Allowlist())
    # Names the allowed module imported from elsewhere do not slip through.
    with pytest.raises(ForbiddenGlobalError, match=r"it is defined in '(posix|nt)'"):
        loads_restricted(_global(FX, "getcwd", protocol), allow)
    with pytest.raises(ForbiddenGlobalError, match="it is a module"):
        loads_restricted(_global(FX, "os", protocol), allow)
    if protocol >= 4:  # dotted names need STACK_GLOBAL
        with pytest.raises(ForbiddenGlobalError, match=r"it is defined in '(posix|nt)'"):
            loads_restricted(_global(FX, "os.getcwd", protocol), allow)


def test_module_wildcard_and_exact_globals(protocol):
    payload = pickling.dumps(fx_restricted.build(), protocol=protocol)
    assert loads_restricted(payload, Allowlist(modules=["tests.pickling.*"])).lr == 0.1
    assert loads_restricted(payload, Allowlist(globals=[f"{FX}.Config"])).name == "run"
    with pytest.raises(ForbiddenGlobalError):  # "tests.pickling" is not "tests.pickling.*"
        loads_restricted(payload, Allowlist(modules=["tests.pickling"]))
    # An exact name is the user's explicit word, even for a re-exported function.
    assert loads_restricted(_global(FX, "getcwd", protocol),
                            Allowlist(globals=[f"{FX}.getcwd"])) is os.getcwd  # fmt: skip


def test_data_false_admits_nothing_by_default(protocol):
    with pytest.raises(ForbiddenGlobalError, match=r"'builtins\.set'"):
        loads_restricted(pickle.dumps({1}, protocol=min(protocol, 3)), Allowlist(data=False))
    assert loads_restricted(pickle.dumps([1, {"a": (2,)}], protocol=protocol),
                            Allowlist(data=False)) == [1, {"a": (2,)}]  # fmt: skip


def test_numpy_and_torch_presets(protocol):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    arr = np.arange(6.0).reshape(2, 3)
    t = torch.arange(4, dtype=torch.float32)
    payload = pickling.dumps((arr, t), protocol=protocol)
    arr2, t2 = loads_restricted(payload, Allowlist(globals=Allowlist.NUMPY + Allowlist.TORCH))
    assert (arr2 == arr).all() and torch.equal(t2, t)
    with pytest.raises(ForbiddenGlobalError, match="numpy"):
        loads_restricted(payload, Allowlist(globals=Allowlist.TORCH))


def test_out_of_band_buffers_and_files(tmp_path):
    buffers: list = []
    payload = pickling.dumps(memoryview(b"x" * 100), protocol=5, buffer_callback=buffers.append)
    assert loads_restricted(payload, Allowlist(), buffers=buffers).tobytes() == b"x" * 100
    path = tmp_path / "p.pkl"
    with open(path, "wb") as f:
        pickling.dump({"a": 1}, f)
    with open(path, "rb") as f:
        assert pickling.load_restricted(f, Allowlist()) == {"a": 1}
    unpickler = pickling.RestrictedUnpickler(io.BytesIO(pickling.dumps({1})), Allowlist())
    assert unpickler.load() == {1}


def test_signed_and_restricted_together():
    key = b"k" * 32
    assert pickling.loads_signed(pickling.dumps_signed([1, {2}], key), key,
                                 allow=Allowlist()) == [1, {2}]  # fmt: skip
    signed_code = pickling.dumps_signed(lambda: 1, key)
    with pytest.raises(ForbiddenGlobalError):
        pickling.loads_signed(signed_code, key, allow=Allowlist())
    assert pickling.loads_signed(signed_code, key)() == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"modules": "numpy"}, TypeError, r"takes a list of names, got the string 'numpy'"),
        ({"globals": "os.path"}, TypeError, r"write globals=\['os.path'\]"),
        ({"modules": ["builtins"]}, ValueError, "may not admit 'builtins' as a whole"),
        ({"modules": ["os.*"]}, ValueError, r"may not admit 'os\.\*' as a whole"),
        ({"modules": ["cadence.pickling"]}, ValueError, "may not admit 'cadence.pickling'"),
        ({"modules": [".rel"]}, ValueError, "'.rel' is not a dotted name"),
        ({"globals": [""]}, ValueError, "'' is not a dotted name"),
        ({"data": "yes"}, TypeError, r"data=\.\.\.\) must be True or False"),
    ],
)
def test_allowlist_misuse(kwargs, error, message):
    with pytest.raises(error, match=message):
        Allowlist(**kwargs)


def test_restricted_unpickler_needs_an_allowlist():
    with pytest.raises(TypeError, match=r"allow= takes a cadence\.pickling\.Allowlist"):
        pickling.RestrictedUnpickler(io.BytesIO(b""), ["os"])  # type: ignore[arg-type]
