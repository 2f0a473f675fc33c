"""Behaviours B19-B29 and the API, in process (B1-B18 are in test_behaviours.py).

Each test round-trips through ``cadence.pickling.dumps`` and the *standard*
``pickle.loads`` and compares real values. The fresh-interpreter versions of the
behaviours where the process boundary matters are in test_subprocess.py.
"""

import dataclasses
import enum
import functools
import pickle
import sys
import threading
import types

import pytest

from cadence import pickling
from tests.pickling.fixtures import fx_model, fx_shared


def rt(obj, protocol=None):
    return pickle.loads(pickling.dumps(obj, protocol=protocol))


def rt_rebuilt(obj):
    """Round trip with the class tracker emptied, so dynamic classes are rebuilt here
    (otherwise the tracker hands back the live classes and the test proves nothing)."""
    import weakref

    from cadence.pickling import _reconstructors as R

    data = pickling.dumps(obj)
    saved = R._TRACKER_BY_ID, R._COMPLETE
    R._TRACKER_BY_ID, R._COMPLETE = weakref.WeakValueDictionary(), weakref.WeakSet()
    try:
        return pickle.loads(data)
    finally:
        R._TRACKER_BY_ID, R._COMPLETE = saved


# B19 / B20 -----------------------------------------------------------------------------
def test_b19_modules_by_reference():
    import json

    def make():
        def f():
            return json

        return f

    assert rt(make())() is json
    assert rt(json) is json


def test_b20_submodule_reached_by_attribute_is_named():
    import xml.etree.ElementTree

    def make():
        def f():
            return xml.etree.ElementTree.Comment

        return f

    data = pickling.dumps(make())
    assert b"xml.etree.ElementTree" in data
    assert pickle.loads(data)() is xml.etree.ElementTree.Comment


# B21 -----------------------------------------------------------------------------------
def test_b21_local_classes_enums_dataclasses_and_instances():
    def make():
        class Color(enum.Enum):
            RED = 1
            BLUE = 2

            def shout(self):
                return self.name.upper()

        @dataclasses.dataclass
        class Cfg:
            lr: float
            tags: list = dataclasses.field(default_factory=list)

        class Base:
            def who(self):
                return "base"

        class Child(Base):
            __slots__ = ("v",)

            def who(self):
                return "child of " + super().who()

        return Color, Cfg, Child

    Color, Cfg, Child = make()
    child = Child()
    child.v = 7
    Color2, Cfg2, Child2, red, cfg, child2 = rt_rebuilt(
        (Color, Cfg, Child, Color.BLUE, Cfg(0.1, ["a"]), child)
    )
    assert Color2 is not Color and Cfg2 is not Cfg and Child2 is not Child
    assert red is Color2.BLUE and red.shout() == "BLUE"
    assert [f.name for f in dataclasses.fields(Cfg2)] == ["lr", "tags"]
    assert cfg == Cfg2(0.1, ["a"]) and Cfg2(1.0).tags == []
    assert child2.who() == "child of base" and child2.v == 7
    assert isinstance(child2, Child2)


# B22 / B23 -----------------------------------------------------------------------------
def test_b22_hand_built_bound_method():
    def make():
        class State:
            def __init__(self):
                self.n = 3

        def on_step(self, k):
            return self.n * k

        return types.MethodType(on_step, State())

    m = rt(make())
    assert isinstance(m, types.MethodType)
    assert m(2) == 6


def test_b23_property_named_like_the_method_is_not_run():
    calls = []

    def make():
        def step(self):
            return "method"

        class Receiver:
            @property
            def step(self):
                calls.append(1)
                return lambda: "property"

        return types.MethodType(step, Receiver())

    m = rt(make())
    assert m() == "method"
    assert calls == []


def test_b22_partial_as_func():
    def make():
        class R:
            pass

        return types.MethodType(functools.partial(lambda a, s: (a, type(s).__name__), 1), R())

    m = rt(make())
    assert m() == (1, "R")


# B24 -----------------------------------------------------------------------------------
def test_b24_generator_refused_with_path():
    def gen():
        yield 1

    def make():
        g = gen()

        def f():
            return g

        return f

    with pytest.raises(pickling.UnpicklableError, match=r"generator.*__closure__\['g'\]"):
        pickling.dumps(make())


def test_b24_coroutine_refused():
    async def coro():
        return 1

    c = coro()
    try:
        with pytest.raises(TypeError, match="coroutine"):
            pickling.dumps({"c": c})
    finally:
        c.close()


# B25 / B26 -----------------------------------------------------------------------------
def test_b25_module_level_lambda_by_value():
    data = pickling.dumps(fx_model.mod_lambda)
    assert b"_make_function" in data
    assert pickle.loads(data)(4) == 12


def test_b26_partial_of_local_function():
    def make():
        def add(a, b):
            return a + b

        return functools.partial(add, 1)

    p = rt(make())
    assert p(2) == 3


# B28 -----------------------------------------------------------------------------------
def test_b28_code_from_another_python_refused_clearly():
    from cadence.pickling import _reconstructors

    with pytest.raises(pickle.UnpicklingError, match=r"compiled by Python 3\.0"):
        _reconstructors._make_code((3, 0), ())


# B29 -----------------------------------------------------------------------------------
def test_b29_error_names_path_and_keeps_type():
    class BadReduce:
        def __reduce__(self):
            raise ValueError("no way")

    def make():
        cfg = types.SimpleNamespace(lock=threading.Lock(), bad=None)

        def fn():
            return cfg

        return fn

    with pytest.raises(TypeError, match=r"reached via \S*make\.<locals>\.fn\.__closure__\['cfg'\]\.lock"):
        pickling.dumps(make())
    with pytest.raises(ValueError, match=r"no way \(reached via obj\['k'\]\[1\]\)"):
        pickling.dumps({"k": [1, BadReduce()]})


def test_b29_recursion_error_becomes_picklingerror():
    deep: list = []
    node = deep
    for _ in range(sys.getrecursionlimit() * 4):
        node.append([])
        node = node[0]
    with pytest.raises(pickle.PicklingError, match="recursion limit") as info:
        pickling.dumps(deep)
    assert isinstance(info.value.__cause__, RecursionError)


# Registry and API ----------------------------------------------------------------------
def test_registry_round_trip():
    assert fx_shared.__name__ not in pickling.list_registry_pickle_by_value()
    pickling.register_pickle_by_value(fx_shared)
    assert fx_shared.__name__ in pickling.list_registry_pickle_by_value()
    assert b"_make_function" in pickling.dumps(fx_shared.read)
    pickling.unregister_pickle_by_value(fx_shared)
    assert pickle.loads(pickling.dumps(fx_shared.read)) is fx_shared.read
    with pytest.raises(ValueError):
        pickling.unregister_pickle_by_value(fx_shared)
    with pytest.raises(ValueError):
        pickling.register_pickle_by_value("not a module")


def test_dump_load_file_and_protocols(tmp_path):
    def make(k):
        return lambda x: x + k

    for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"p{proto}.pkl"
        with open(path, "wb") as fh:
            pickling.dump(make(proto), fh, protocol=proto)
        with open(path, "rb") as fh:
            assert pickling.load(fh)(1) == proto + 1
    assert pickling.DEFAULT_PROTOCOL == pickle.HIGHEST_PROTOCOL


def test_pickler_subclass_reducer_override_and_dispatch_table():
    import io

    class Token:
        pass

    class Other:
        pass

    class MyPickler(pickling.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, Token):
                return str, ("token",)
            return super().reducer_override(obj)

    buf = io.BytesIO()
    p = MyPickler(buf)
    p.dispatch_table = {Other: lambda o: (int, (7,))}
    p.dump((Token(), Other(), lambda: 1))
    tok, other, fn = pickle.loads(buf.getvalue())
    assert (tok, other, fn()) == ("token", 7, 1)


def test_buffer_callback_out_of_band():
    payload = bytearray(b"x" * 1000)
    buffers: list = []
    data = pickling.dumps(pickle.PickleBuffer(payload), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and len(data) < 100
    assert bytes(pickle.loads(data, buffers=buffers)) == bytes(payload)


def test_dynamic_class_identity_across_two_payloads():
    def make():
        class K:
            pass

        return K

    K = make()
    a = pickle.loads(pickling.dumps(K))
    b = pickle.loads(pickling.dumps(K))
    assert a is K and b is K  # the tracker maps back onto the live class in this process


def test_b19_dynamic_module_by_value():
    mod = types.ModuleType("cadence_test_dynamic_mod")
    exec("BASE = 40\ndef answer():\n    return BASE + 2\n", mod.__dict__)

    def make():
        def f():
            return mod.answer()

        return f

    f = rt(make())
    assert f() == 42
    assert f.__closure__[0].cell_contents is not mod  # rebuilt, not the live module


def test_container_subclasses_and_plain_instances_unchanged():
    import collections

    def make():
        class Box:
            def __init__(self):
                self.items = collections.OrderedDict(a=1, b=2)
                self.counts = collections.defaultdict(int, {"x": 3})
                self.tags = frozenset({"p", "q"})

        return Box()

    box = rt(make())
    assert list(box.items.items()) == [("a", 1), ("b", 2)]
    assert box.counts["x"] == 3 and box.counts["missing"] == 0
    assert box.tags == frozenset({"p", "q"})


def test_builtin_types_by_name():
    assert rt(types.FunctionType) is types.FunctionType
    assert rt(type(None)) is type(None)
    assert rt(len) is len


def test_local_abc_keeps_its_registry():
    import abc

    def make():
        class Shape(abc.ABC):
            @abc.abstractmethod
            def area(self): ...

        class Square:
            def area(self):
                return 4

        Shape.register(Square)
        return Shape, Square

    classes = make()
    shape, square = rt_rebuilt(classes)
    assert shape is not classes[0] and square is not classes[1]
    assert isinstance(square(), shape)
    with pytest.raises(TypeError):
        shape()


def test_local_class_descriptors_rebuilt():
    def make():
        class K:
            base = 2

            @property
            def twice(self):
                return self.base * 2

            @classmethod
            def make(cls):
                return cls()

            @staticmethod
            def add(a, b):
                return a + b

        return K

    live = make()
    k = rt_rebuilt(live)
    assert k is not live
    assert isinstance(k.__dict__["twice"], property)
    assert k.make().twice == 4 and k.add(2, 3) == 5
    assert rt(types.MappingProxyType({"a": 1})) == {"a": 1}
