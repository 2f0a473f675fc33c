"""No hostile payload runs code under the default allowlist or any allowlist the docs show.

- Every payload below tries to run code (the code it smuggles creates a marker file):
  attribute walks through STACK_GLOBAL, GLOBAL and INST; code-running globals called by
  REDUCE, OBJ, NEWOBJ and INST; ``functools.partial`` and ``operator.attrgetter``
  gadgets; ``copyreg._reconstructor`` with a code-running base; a function rebuilt by
  value through cadence's reconstructors. Under each allowlist shape the load raises
  and the marker is never created.
- Resource exhaustion: a length prefix larger than the payload is refused as truncated
  (``MalformedPayloadError``) without allocating what it claims, from bytes and from a
  file; deep nesting loads without recursion.
"""

from __future__ import annotations

import pickle
import struct

import pytest

from cadence import pickling
from cadence.pickling import Allowlist, load_restricted, loads_restricted
from tests.pickling import _payloads as p

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free

FXH = p.FXH

# The allowlist shapes docs/pickling.md shows, with this repository's fixture module in
# place of ``myproject.configs``. The torch names are only named, never resolved here.
SHAPES = {
    "default": Allowlist(),
    "no-data": Allowlist(data=False),
    "module": Allowlist(modules=[FXH]),
    "module+numpy": Allowlist(modules=[FXH], globals=Allowlist.NUMPY),
    "wildcard": Allowlist(modules=["tests.pickling.*"]),
    "exact": Allowlist(globals=[f"{FXH}.Point", f"{FXH}.make_point"]),
    "presets": Allowlist(globals=Allowlist.NUMPY + Allowlist.TORCH),
    "collections": Allowlist(modules=["collections"]),
}


def _code(marker) -> bytes:
    return p.text(p.marker_code(marker))


def _walk(module: str, name: str, marker) -> bytes:
    return p.call(p.call(p.stack_global(module, name), p.text("exec")), _code(marker))


# Each builds the payload for a marker path; every one runs the marker code when loaded
# with plain ``pickle.loads`` (checked below), so a refusal is what keeps it out.
HOSTILE = {
    "walk-function": lambda m: _walk(FXH, "make_point.__builtins__.get", m),
    "walk-class": lambda m: _walk(FXH, "Point.__init__.__builtins__.get", m),
    "walk-collections": lambda m: _walk("collections", "namedtuple.__builtins__.get", m),
    "walk-global-opcode": lambda m: p.call(
        p.call(p.global_op(FXH, "make_point.__builtins__.get"), p.text("exec")), _code(m)),
    "walk-inst": lambda m: p.call(
        pickle.MARK + p.text("exec") + pickle.INST
        + f"{FXH}\nmake_point.__builtins__.get\n".encode(), _code(m)),
    "exec": lambda m: p.call(p.stack_global("builtins", "exec"), _code(m)),
    "eval-global-opcode": lambda m: p.call(p.global_op("builtins", "eval"), _code(m)),
    "exec-obj": lambda m: pickle.MARK + p.stack_global("builtins", "exec") + _code(m)
    + pickle.OBJ,
    "exec-inst": lambda m: pickle.MARK + _code(m) + pickle.INST + b"builtins\nexec\n",
    "system": lambda m: p.call(p.stack_global("os", "system"),
                               p.text(f"touch {str(m)!r}")),
    "partial": lambda m: p.call(p.call(p.stack_global("functools", "partial"),
                                       p.stack_global("builtins", "exec"), _code(m))),
    "attrgetter": lambda m: p.call(
        p.call(p.call(p.stack_global("operator", "attrgetter"), p.text("exec")),
               p.call(p.stack_global("importlib", "import_module"), p.text("builtins"))),
        _code(m)),
    "reconstructor-base": lambda m: p.call(
        p.stack_global("copyreg", "_reconstructor"), p.stack_global("functools", "partial"),
        p.stack_global("functools", "partial"), p.stack_global("builtins", "exec"))
    + p.tuple_of(_code(m)) + pickle.REDUCE,
    "newobj": lambda m: p.stack_global("functools", "partial")
    + p.tuple_of(p.stack_global("builtins", "exec"), _code(m)) + pickle.NEWOBJ
    + pickle.EMPTY_TUPLE + pickle.REDUCE,
}  # fmt: skip


def _by_value(marker) -> bytes:
    """A function rebuilt by value, then called: cadence's own reconstructors."""

    def touch():
        marker.touch()

    class CallOnLoad:
        def __reduce__(self):
            return touch, ()

    return pickling.dumps(CallOnLoad(), protocol=4)


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_each_hostile_payload_runs_code_when_unrestricted(tmp_path, attack):
    """The payloads are real: plain pickle.loads runs each (so refusal is what stops it)."""
    marker = tmp_path / "ran"
    try:
        pickle.loads(p.payload(HOSTILE[attack](marker)))
    except Exception:  # a gadget may raise after it ran the code
        pass
    assert p.ran_code(marker)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_no_hostile_payload_runs_code(tmp_path, shape, attack):
    marker = tmp_path / "ran"
    with pytest.raises(pickle.UnpicklingError):
        loads_restricted(p.payload(HOSTILE[attack](marker)), SHAPES[shape])
    assert not p.ran_code(marker)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_no_function_by_value_runs(tmp_path, shape):
    marker = tmp_path / "ran"
    with pytest.raises(pickling.ForbiddenGlobalError, match=r"cadence\.pickling\._reconstructors"):
        loads_restricted(_by_value(marker), SHAPES[shape])
    assert not p.ran_code(marker)


# Resource exhaustion ------------------------------------------------------------------------
_HUGE = 1 << 40  # a TiB: never allocated, only claimed


@pytest.mark.parametrize(
    "header",
    [pickle.BYTEARRAY8 + struct.pack("<Q", _HUGE), pickle.BINBYTES8 + struct.pack("<Q", _HUGE),
     pickle.BINUNICODE8 + struct.pack("<Q", _HUGE)],
    ids=["BYTEARRAY8", "BINBYTES8", "BINUNICODE8"],
)  # fmt: skip
def test_a_length_prefix_beyond_the_payload_is_truncated_not_allocated(tmp_path, header):
    data = p.payload(header + b"abc", protocol=5)
    with pytest.raises(pickling.MalformedPayloadError, match="truncated"):
        loads_restricted(data, Allowlist())
    path = tmp_path / "payload.pkl"
    path.write_bytes(data)
    with open(path, "rb") as f, pytest.raises(pickling.MalformedPayloadError, match="truncated"):
        load_restricted(f, Allowlist())


def test_deep_nesting_loads_without_recursion():
    # [[[...]]] 100,000 deep, built with constant stack depth through the memo.
    depth = 100_000
    step = pickle.EMPTY_LIST + pickle.BINGET + b"\x00" + pickle.APPEND + pickle.BINPUT + b"\x00"
    data = p.payload(pickle.EMPTY_LIST + pickle.BINPUT + b"\x00" + step * depth)
    nested = loads_restricted(data, Allowlist())
    for _ in range(depth):
        (nested,) = nested
    assert nested == []


def test_a_file_is_left_just_after_the_pickle(tmp_path):
    path = tmp_path / "two.pkl"
    path.write_bytes(pickling.dumps([1, b"x" * 5000]) + pickling.dumps({"b": 2}))
    with open(path, "rb") as f:
        assert load_restricted(f, Allowlist()) == [1, b"x" * 5000]
        assert load_restricted(f, Allowlist()) == {"b": 2}
