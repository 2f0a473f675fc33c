"""Modules (B19, B20): by reference when importable, by value when dynamic or registered,
and submodules reached by attribute; the by-value registry and its misuse."""

import collections.abc
import os.path
import pickle
import sys
import types

import pytest

from cadence import pickling
from tests.pickling._harness import ROOT, load_in_child, rt
from tests.pickling.fixtures import fx_local_only, fx_shared

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free


def _dynamic_module(name="mod"):
    mod = types.ModuleType(name)
    exec(
        "x = 1\ndef f(y):\n    return x + y\n"
        "class Foo:\n    def method(self, x):\n        return f(x)\n",
        mod.__dict__,
    )
    return mod


# B19 -------------------------------------------------------------------------------------
def test_b19_importable_modules_by_reference(protocol):
    for module in (pickle, os.path, collections, collections.abc):
        assert rt(module, protocol) is module
    data = pickling.dumps(pickle, protocol=protocol)
    assert len(data) < 100  # a name, not a namespace


@pytest.mark.parametrize("package", ["none", "deleted"])
def test_b19_dynamic_module_by_value(protocol, package):
    mod = _dynamic_module()
    if package == "deleted":
        del mod.__package__
    mod2 = rt(mod, protocol)
    assert mod2 is not mod and mod2.__name__ == "mod" and "mod" not in sys.modules
    assert (mod2.x, mod2.f(5), mod2.Foo().method(5)) == (1, 6, 6)
    m1, m2 = rt([mod, mod], protocol)
    assert m1 is m2  # one module in one payload stays one module


def test_b19_function_of_a_dynamic_module_registered_in_sys_modules(protocol):
    mod = _dynamic_module("cadence_test_dyn")
    sys.modules[mod.__name__] = mod
    try:
        assert rt(mod.f, protocol) is mod.f  # looks file-backed: by reference
    finally:
        del sys.modules[mod.__name__]
    assert rt(mod.f, protocol)(5) == 6  # gone from sys.modules: by value


def test_b19_module_whose_builtins_hold_an_unpicklable_object(protocol):
    class Unpicklable:
        def __reduce__(self):
            raise ValueError("Unpicklable object")

    mod = types.ModuleType("mod")
    exec("f = lambda x: abs(x)", mod.__dict__)
    builtins_ns = mod.__dict__["__builtins__"]
    key = "cadence_test_unpicklable"
    if isinstance(builtins_ns, dict):
        builtins_ns[key] = Unpicklable()
    else:
        setattr(builtins_ns, key, Unpicklable())
    try:
        mod2 = rt(mod, protocol)
    finally:
        if isinstance(builtins_ns, dict):
            del builtins_ns[key]
        else:
            delattr(builtins_ns, key)
    assert mod2.f(-1) == 1 and mod.f(-1) == 1


def test_b19_function_reading_a_dynamic_module(protocol):
    mod = types.ModuleType("cadence_test_dynamic_mod")
    exec("BASE = 40\ndef answer():\n    return BASE + 2\n", mod.__dict__)

    def f():
        return mod.answer()

    g = rt(f, protocol)
    assert g() == 42 and g.__closure__[0].cell_contents is not mod


# Registered modules (by value) -------------------------------------------------------------
def test_registered_module_ships_as_a_module_to_a_process_that_cannot_import_it(protocol, tmp_path):
    pickling.register_pickle_by_value(fx_local_only)
    try:
        payload = pickling.dumps(
            {
                "module": fx_local_only,
                "via_closure": (lambda: fx_local_only.uses_helper(1)),
                "items": [fx_local_only.uses_helper, fx_local_only.Point(5),
                          fx_local_only.Mode.SLOW, fx_local_only.mod_lambda],
            },
            protocol=protocol,
        )  # fmt: skip
    finally:
        pickling.unregister_pickle_by_value(fx_local_only)
    check = """
    try:
        import tests.pickling.fixtures.fx_local_only
        importable = True
    except ImportError:
        importable = False
    mod = obj["module"]
    uses_helper, point, mode, lam = obj["items"]
    result = [importable, type(mod).__name__, mod.__name__, mod.helper(1), mod.OFFSET,
              mod.Point(2).shifted(), obj["via_closure"](), uses_helper(1), point.shifted(),
              mode.name, type(mode).FAST.value, lam(1), mod.make_closure(3)(1),
              mod.__name__ in sys.modules]
    """
    got = load_in_child(payload, check, cwd=tmp_path, path=[])
    assert got == [False, "module", fx_local_only.__name__, 11, 10, 12, 22, 22, 15,
                   "SLOW", 1, 0, 4, False]  # fmt: skip


def test_unregistered_closure_loads_without_its_module(protocol, tmp_path):
    # A closure whose globals and cells hold only by-value data needs no import.
    payload = pickling.dumps(fx_local_only.make_closure(4), protocol=protocol)
    assert load_in_child(payload, "result = obj(1)", cwd=tmp_path, path=[]) == 5


def test_registering_a_package_covers_its_submodules_only_downwards(protocol):
    import tests.pickling.fixtures as fixtures

    pickling.register_pickle_by_value(fixtures)
    try:
        assert b"_make_function" in pickling.dumps(fx_shared.read, protocol=protocol)
    finally:
        pickling.unregister_pickle_by_value(fixtures)
    pickling.register_pickle_by_value(fx_shared)
    try:  # a registered submodule does not make its parent package by value
        assert rt(fixtures.package_function, protocol) is fixtures.package_function
    finally:
        pickling.unregister_pickle_by_value(fx_shared)


def test_various_versions_of_one_function_coexist(protocol):
    by_ref = pickling.dumps(fx_shared.read, protocol=protocol)
    pickling.register_pickle_by_value(fx_shared)
    try:
        by_value = pickling.dumps(fx_shared.read, protocol=protocol)
    finally:
        pickling.unregister_pickle_by_value(fx_shared)
    assert pickle.loads(by_ref) is fx_shared.read
    copy = pickle.loads(by_value)
    assert copy is not fx_shared.read and copy() == fx_shared.read()


def test_registry_api_and_its_misuse():
    assert fx_shared.__name__ not in pickling.list_registry_pickle_by_value()
    pickling.register_pickle_by_value(fx_shared)
    listed = pickling.list_registry_pickle_by_value()
    assert fx_shared.__name__ in listed
    listed.clear()  # a copy: clearing it changes nothing
    assert fx_shared.__name__ in pickling.list_registry_pickle_by_value()
    pickling.unregister_pickle_by_value(fx_shared)
    with pytest.raises(ValueError, match="is not registered for pickling by value"):
        pickling.unregister_pickle_by_value(fx_shared)
    with pytest.raises(ValueError, match="expects a module, got 'not a module'"):
        pickling.register_pickle_by_value("not a module")
    with pytest.raises(ValueError, match="unregister_pickle_by_value expects a module"):
        pickling.unregister_pickle_by_value(fx_shared.__name__)
    with pytest.raises(ValueError, match=r"not in sys\.modules under its own name"):
        pickling.register_pickle_by_value(types.ModuleType("dynamic_mod"))


# B20: submodules ---------------------------------------------------------------------------
def test_b20_submodule_reached_by_attribute_is_named(protocol):
    import xml.etree.ElementTree

    def example():
        return xml.etree.ElementTree.Comment

    data = pickling.dumps(example, protocol=protocol)
    assert b"xml.etree.ElementTree" in data
    assert pickle.loads(data)() is xml.etree.ElementTree.Comment


def test_b20_submodules_imported_again_at_load(protocol, tmp_path):
    # The loading interpreter has not imported xml at all.
    def scope():
        import xml.etree as foobar
        import xml.etree.ElementTree

        def example():
            return xml.etree.ElementTree.Comment("x").tag is foobar.ElementTree.Comment

        return example

    payload = pickling.dumps(scope(), protocol=protocol)
    pre = 'had_xml = "xml.etree" in sys.modules'
    got = load_in_child(payload, "result = [had_xml, obj()]", cwd=tmp_path, pre=pre)
    assert got == [False, True]


# Junk in sys.modules ----------------------------------------------------------------------
@pytest.mark.parametrize("base_class", [object, types.ModuleType])
@pytest.mark.parametrize("module_name", ["_missing_module", None])
def test_unrelated_faulty_entries_in_sys_modules_are_harmless(protocol, base_class, module_name):
    class FaultyModule(base_class):
        def __getattr__(self, name):
            raise Exception()

    class Foo:
        __module__ = module_name

        def foo(self):
            return "it works!"

    def foo():
        return "it works!"

    foo.__module__ = module_name
    faulty = FaultyModule("_faulty_module") if base_class is types.ModuleType else FaultyModule()
    sys.modules["_faulty_module"] = faulty
    try:
        assert rt(Foo(), protocol).foo() == "it works!"
        assert rt(foo, protocol)() == "it works!"
    finally:
        sys.modules.pop("_faulty_module", None)


def test_module_level_function_in_a_test_module_round_trips_in_a_child(protocol, tmp_path):
    payload = pickling.dumps(_dynamic_module, protocol=protocol)
    got = load_in_child(payload, "result = obj('m').f(1)", cwd=tmp_path, path=[str(ROOT)])
    assert got == 2
