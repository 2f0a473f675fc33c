"""A restricted load changes only the objects the payload itself created.

- BUILD (``__setstate__``, ``__dict__`` update or setattr) is refused on a class, on a
  function and on any object a global named (a module-level instance), even when the
  class or function is allowed; the object is left as it was.
- BUILD is refused on a class an allowed function returned, and on an enum member an
  allowed enum returned (calling an enum returns its existing member).
- APPEND, APPENDS, SETITEM and ADDITEMS are refused on a class or on an object a global
  named: no class-level ``append``/``extend``/``add`` is called, no module-level dict
  gains a key.
- BUILD may not set dunder attributes through setattr (a payload would swap a fresh
  instance's ``__dict__`` for a global dict and write into it).
- BUILD on an instance the payload created stays allowed: dataclasses, ``__slots__``
  classes, and an allowed class's own ``__setstate__`` (which runs, with the payload's
  state).
"""

from __future__ import annotations

import pickle

import pytest

from cadence import pickling
from cadence.pickling import Allowlist, ForbiddenGlobalError, loads_restricted
from tests.pickling import _payloads as p
from tests.pickling.fixtures import fx_hostile

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free

FXH = p.FXH
ALLOW_FXH = Allowlist(modules=[FXH])


def _fresh_point() -> bytes:
    """A Point the payload creates: ``copyreg._reconstructor(Point, object, None)``."""
    return p.call(p.stack_global("copyreg", "_reconstructor"), p.stack_global(FXH, "Point"),
                  p.stack_global("builtins", "object"), pickle.NONE)  # fmt: skip


def _forget(cls: type, name: str) -> None:
    """Undo what the payload would have set, so a failure does not leak into other tests."""
    if name in vars(cls):
        delattr(cls, name)


def test_build_on_an_allowed_class_is_refused():
    state = p.slot_state((p.text("injected"), p.integer(1)))
    try:
        with pytest.raises(ForbiddenGlobalError, match=r"BUILD.*is a class") as info:
            loads_restricted(p.payload(p.build(p.stack_global(FXH, "Point"), state)), ALLOW_FXH)
        assert info.value.global_name == f"{FXH}.Point"
        assert "injected" not in vars(fx_hostile.Point)
    finally:
        _forget(fx_hostile.Point, "injected")


def test_build_on_an_allowed_function_is_refused():
    before = fx_hostile.make_point.__defaults__
    state = p.slot_state((p.text("__defaults__"), p.tuple_of(p.integer(5), p.integer(6))))
    try:
        with pytest.raises(ForbiddenGlobalError, match=r"BUILD.*is a function"):
            loads_restricted(p.payload(p.build(p.stack_global(FXH, "make_point"), state)),
                             ALLOW_FXH)  # fmt: skip
        assert fx_hostile.make_point() == fx_hostile.Point(0, 0)
    finally:
        fx_hostile.make_point.__defaults__ = before


def test_build_on_a_module_level_instance_named_exactly_is_refused():
    allow = Allowlist(globals=[f"{FXH}.DEFAULT"])
    state = p.dict_of((p.text("x"), p.integer(99)))
    try:
        with pytest.raises(ForbiddenGlobalError, match=r"BUILD.*the global '.*\.DEFAULT'"):
            loads_restricted(p.payload(p.build(p.stack_global(FXH, "DEFAULT"), state)), allow)
        assert (fx_hostile.DEFAULT.x, fx_hostile.DEFAULT.y) == (1, 2)
    finally:
        fx_hostile.DEFAULT.x = 1


def test_build_on_a_class_an_allowed_function_returned_is_refused():
    returned = p.call(p.stack_global(FXH, "point_class"))
    state = p.slot_state((p.text("injected"), p.integer(1)))
    try:
        with pytest.raises(ForbiddenGlobalError, match=r"BUILD.*is a class"):
            loads_restricted(p.payload(p.build(returned, state)), ALLOW_FXH)
        assert "injected" not in vars(fx_hostile.Point)
    finally:
        _forget(fx_hostile.Point, "injected")


def test_build_on_an_enum_member_is_refused():
    member = p.call(p.stack_global(FXH, "Color"), p.integer(1))
    state = p.dict_of((p.text("injected"), p.integer(1)))
    try:
        with pytest.raises(ForbiddenGlobalError, match=r"BUILD.*is an enum member"):
            loads_restricted(p.payload(p.build(member, state)), ALLOW_FXH)
        assert "injected" not in vars(fx_hostile.Color.RED)
    finally:
        vars(fx_hostile.Color.RED).pop("injected", None)


@pytest.mark.parametrize(
    ("opcodes", "hook"),
    [
        (p.integer(1) + pickle.APPEND, "append"),
        (pickle.MARK + p.integer(1) + p.integer(2) + pickle.APPENDS, "extend"),
        (pickle.MARK + p.integer(1) + pickle.ADDITEMS, "add"),
    ],
    ids=["APPEND", "APPENDS", "ADDITEMS"],
)
def test_container_opcodes_on_an_allowed_class_call_nothing(opcodes, hook):
    fx_hostile.Ledger.calls.clear()
    try:
        with pytest.raises(ForbiddenGlobalError, match="is a class"):
            loads_restricted(p.payload(p.stack_global(FXH, "Ledger") + opcodes), ALLOW_FXH)
        assert fx_hostile.Ledger.calls == []
    finally:
        fx_hostile.Ledger.calls.clear()


@pytest.mark.parametrize(
    "opcodes",
    [
        p.text("evil") + p.integer(1) + pickle.SETITEM,
        pickle.MARK + p.text("evil") + p.integer(1) + pickle.SETITEMS,
    ],
    ids=["SETITEM", "SETITEMS"],
)
def test_setitem_on_a_module_level_dict_is_refused(opcodes):
    allow = Allowlist(globals=[f"{FXH}.REGISTRY"])
    try:
        with pytest.raises(ForbiddenGlobalError, match=r"the global '.*\.REGISTRY'"):
            loads_restricted(p.payload(p.stack_global(FXH, "REGISTRY") + opcodes), allow)
        assert fx_hostile.REGISTRY == {"k": "v"}
    finally:
        fx_hostile.REGISTRY.pop("evil", None)


def test_build_may_not_swap_an_instance_dict_for_a_global_one():
    allow = Allowlist(modules=[FXH], globals=[f"{FXH}.REGISTRY"])
    swap = p.slot_state((p.text("__dict__"), p.stack_global(FXH, "REGISTRY")))
    write = p.dict_of((p.text("evil"), p.integer(1)))
    try:
        with pytest.raises(ForbiddenGlobalError, match="'__dict__'"):
            loads_restricted(p.payload(p.build(p.build(_fresh_point(), swap), write)), allow)
        assert fx_hostile.REGISTRY == {"k": "v"}
    finally:
        fx_hostile.REGISTRY.pop("evil", None)


def test_build_on_instances_the_payload_created_still_works(protocol):
    data = [fx_hostile.Point(3, 4), fx_hostile.Slotted(1, 2)]
    point, slotted = loads_restricted(pickling.dumps(data, protocol=protocol), ALLOW_FXH)
    assert point == fx_hostile.Point(3, 4) and (slotted.a, slotted.b) == (1, 2)
    built = p.build(_fresh_point(), p.dict_of((p.text("x"), p.integer(5)),
                                              (p.text("y"), p.integer(6))))  # fmt: skip
    assert loads_restricted(p.payload(built), ALLOW_FXH) == fx_hostile.Point(5, 6)


def test_an_allowed_class_s_own_setstate_runs_with_the_payload_s_state():
    fx_hostile.Stateful.seen.clear()
    try:
        fresh = p.call(p.stack_global(FXH, "Stateful"))
        loaded = loads_restricted(p.payload(p.build(fresh, p.text("hello"))), ALLOW_FXH)
        assert loaded.state == "hello" and fx_hostile.Stateful.seen == ["hello"]
    finally:
        fx_hostile.Stateful.seen.clear()
