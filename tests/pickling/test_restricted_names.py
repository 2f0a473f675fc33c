"""How a restricted load resolves the names a payload writes.

- A dotted name (``Outer.Inner``) is resolved one step at a time, and may only walk
  through classes: the attribute walks from an allowed function or class to ``exec``
  (``make_point.__builtins__.get``, ``Point.__init__.__globals__``) are refused, under
  STACK_GLOBAL, under the protocol 0 GLOBAL opcode and under INST; the default data
  globals (``object``, ``copyreg._reconstructor``) start no walk either.
- Under an allowed module, every step of a dotted name is a class defined in an allowed
  module, and the name's own object is a class or a function defined there: a
  module-level instance or dict (process-wide state) is refused, and so is a builtin
  whose ``__module__`` is None.
- A class nested in an allowed class loads by its dotted name.
- An exact name in ``globals=`` admits what it names, reached through classes only;
  modules are never returned, not even by an exact name.
- EXT codes resolve through the allowlist every time, never through the process-wide
  extension cache another load filled.
- Persistent ids are refused; bytes that are not a pickle raise
  ``MalformedPayloadError``, an ``UnpicklingError``.
"""

from __future__ import annotations

import copyreg
import pickle
import struct

import pytest

from cadence import pickling
from cadence.pickling import Allowlist, ForbiddenGlobalError, loads_restricted
from tests.pickling import _payloads as p
from tests.pickling.fixtures import fx_hostile

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free

FXH = p.FXH
ALLOW_FXH = Allowlist(modules=[FXH])


def _exec_through(global_bytes: bytes, marker) -> bytes:
    """``<global>("exec")(<code>)``: the walk ends at a ``get`` that returns ``exec``."""
    return p.payload(p.call(p.call(global_bytes, p.text("exec")), p.text(p.marker_code(marker))))


@pytest.mark.parametrize(
    ("module", "name", "allow"),
    [
        (FXH, "make_point.__builtins__.get", ALLOW_FXH),
        (FXH, "Point.__init__.__builtins__.get", ALLOW_FXH),
        (FXH, "Point.origin.__func__.__builtins__.get", ALLOW_FXH),
        ("collections", "namedtuple.__builtins__.get", Allowlist(modules=["collections"])),
        (FXH, "make_point.__builtins__.get", Allowlist(modules=["tests.pickling.*"])),
    ],
)
def test_an_attribute_walk_to_exec_is_refused(tmp_path, module, name, allow):
    marker = tmp_path / "ran"
    with pytest.raises(ForbiddenGlobalError, match="may only walk through classes") as info:
        loads_restricted(_exec_through(p.stack_global(module, name), marker), allow)
    assert info.value.global_name == f"{module}.{name}"
    assert not p.ran_code(marker)


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("builtins", "object.__subclasses__"),
        ("builtins", "object.__reduce_ex__"),
        ("builtins", "dict.fromkeys"),
        ("copyreg", "_reconstructor.__globals__"),
        ("collections", "OrderedDict.__init__"),
    ],
)
def test_the_default_data_globals_start_no_walk(module, name):
    with pytest.raises(ForbiddenGlobalError, match="neither it nor its module"):
        loads_restricted(p.payload(p.stack_global(module, name)), Allowlist())


def test_a_dotted_name_in_the_protocol_0_global_opcode_is_refused(tmp_path):
    marker = tmp_path / "ran"
    walk = p.global_op(FXH, "make_point.__builtins__.get")
    with pytest.raises(ForbiddenGlobalError, match="may only walk through classes"):
        loads_restricted(_exec_through(walk, marker), ALLOW_FXH)
    assert not p.ran_code(marker)


def test_a_dotted_name_without_a_protocol_header_is_refused(tmp_path):
    marker = tmp_path / "ran"
    walk = p.global_op(FXH, "make_point.__builtins__.get")
    body = p.call(p.call(walk, p.text("exec")), p.text(p.marker_code(marker)))
    with pytest.raises(ForbiddenGlobalError, match="may only walk through classes"):
        loads_restricted(body + pickle.STOP, ALLOW_FXH)
    assert not p.ran_code(marker)


def test_a_dotted_name_in_the_inst_opcode_is_refused(tmp_path):
    marker = tmp_path / "ran"
    # INST calls the named global with the marked items: get("exec") is exec.
    walk = f"{FXH}\nmake_point.__builtins__.get\n".encode()
    inst = pickle.MARK + p.text("exec") + pickle.INST + walk
    with pytest.raises(ForbiddenGlobalError, match="may only walk through classes"):
        loads_restricted(p.payload(inst + p.tuple_of(p.text(p.marker_code(marker)))
                                   + pickle.REDUCE), ALLOW_FXH)  # fmt: skip
    assert not p.ran_code(marker)


def test_a_function_s_globals_are_refused_under_its_allowed_module():
    with pytest.raises(ForbiddenGlobalError, match="may only walk through classes"):
        loads_restricted(p.payload(p.stack_global(FXH, "make_point.__globals__")), ALLOW_FXH)


def test_a_builtin_whose_module_is_none_is_refused_under_an_allowed_module():
    # ``lookup`` is ``REGISTRY.get``: a builtin bound method, ``__module__`` None.
    with pytest.raises(ForbiddenGlobalError, match="__module__ is None"):
        loads_restricted(p.payload(p.stack_global(FXH, "lookup")), ALLOW_FXH)


@pytest.mark.parametrize("name", ["DEFAULT", "REGISTRY"])
def test_module_level_instances_are_refused_under_an_allowed_module(name):
    with pytest.raises(ForbiddenGlobalError, match="not a class or function") as info:
        loads_restricted(p.payload(p.stack_global(FXH, name)), ALLOW_FXH)
    assert info.value.global_name == f"{FXH}.{name}"


def test_a_nested_class_loads_by_its_dotted_name(protocol):
    payload = pickling.dumps(fx_hostile.Point.Nested(7), protocol=protocol)
    assert loads_restricted(payload, ALLOW_FXH) == fx_hostile.Point.Nested(7)
    exact = Allowlist(globals=[f"{FXH}.Point.Nested"])
    assert loads_restricted(payload, exact) == fx_hostile.Point.Nested(7)


def test_a_dotted_name_under_an_allowed_module_names_a_class_only():
    # A classmethod is a bound method, not a class: admit it by its exact name instead.
    with pytest.raises(ForbiddenGlobalError, match="a dotted name may only name a class"):
        loads_restricted(p.payload(p.stack_global(FXH, "Point.origin")), ALLOW_FXH)


def test_an_exact_name_may_reach_into_a_class():
    allow = Allowlist(globals=[f"{FXH}.Point.origin"])
    loaded = loads_restricted(p.payload(p.stack_global(FXH, "Point.origin")), allow)
    assert loaded() == fx_hostile.Point(0, 0)


def test_an_exact_name_may_not_walk_through_a_function():
    allow = Allowlist(globals=[f"{FXH}.make_point.__globals__"])
    with pytest.raises(ForbiddenGlobalError, match="may only walk through classes"):
        loads_restricted(p.payload(p.stack_global(FXH, "make_point.__globals__")), allow)


def test_a_module_is_never_returned_even_by_an_exact_name():
    allow = Allowlist(globals=[f"{FXH}.os"])
    with pytest.raises(ForbiddenGlobalError, match="it is a module"):
        loads_restricted(p.payload(p.stack_global(FXH, "os")), allow)


@pytest.fixture
def exec_extension():
    """An extension code for ``builtins.exec``, already in the process-wide cache."""
    code = 0x7ABCDE
    copyreg.add_extension("builtins", "exec", code)
    try:
        assert pickle.loads(p.payload(pickle.EXT4 + struct.pack("<i", code))) is exec
        assert copyreg._extension_cache.get(code) is exec
        yield code
    finally:
        copyreg.remove_extension("builtins", "exec", code)


def test_an_extension_code_resolves_through_the_allowlist(tmp_path, exec_extension):
    marker = tmp_path / "ran"
    ext = pickle.EXT4 + struct.pack("<i", exec_extension)
    with pytest.raises(ForbiddenGlobalError, match=r"'builtins\.exec'"):
        loads_restricted(p.payload(p.call(ext, p.text(p.marker_code(marker)))), Allowlist())
    assert not p.ran_code(marker)


def test_an_extension_code_for_an_allowed_class_loads():
    code = 0x7ABCDF
    copyreg.add_extension(FXH, "Point", code)
    try:
        ext = pickle.EXT4 + struct.pack("<i", code)
        loaded = loads_restricted(p.payload(p.call(ext, p.integer(1), p.integer(2))), ALLOW_FXH)
        assert loaded == fx_hostile.Point(1, 2)
    finally:
        copyreg.remove_extension(FXH, "Point", code)


@pytest.mark.parametrize(
    "opcodes",
    [
        p.text("os.system") + pickle.BINPERSID,
        pickle.PERSID + b"os.system\n",
    ],
    ids=["BINPERSID", "PERSID"],
)
def test_persistent_ids_are_refused(opcodes):
    with pytest.raises(pickle.UnpicklingError, match="persistent"):
        loads_restricted(p.payload(opcodes), Allowlist())


def test_an_unknown_opcode_is_a_malformed_payload():
    with pytest.raises(pickling.MalformedPayloadError, match=r"invalid load key"):
        loads_restricted(b"\x80\x04\xff.", Allowlist())
    assert issubclass(pickling.MalformedPayloadError, pickle.UnpicklingError)
