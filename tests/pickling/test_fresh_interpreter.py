"""Round trips through fresh interpreters: the process boundary is where pickling is real.

Payloads are made here with ``cadence.pickling.dumps`` and loaded in a child with the
standard ``pickle.loads``, the way ``cadence.launch`` ships functions to its ranks.
(Workers and ``__main__`` drivers: test_interactive.py; modules a child cannot import:
test_modules.py; hash seeds: test_determinism.py.)
"""

from __future__ import annotations

import functools
import json
import xml.etree.ElementTree

import pytest

from cadence import pickling
from tests.pickling._harness import ROOT, load_in_child, run_python
from tests.pickling.fixtures import fx_model

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free


def _make_closures():
    c = 0

    def inc():
        nonlocal c
        c += 1
        return c

    def get():
        return c

    def fact(n):
        return 1 if n <= 1 else n * fact(n - 1)

    if False:
        unset = 1

    def empty():
        return unset

    return inc, get, fact, empty


def _make_classes():
    import dataclasses
    import enum

    class Color(enum.Enum):
        RED = 1
        BLUE = 2

    @dataclasses.dataclass
    class Cfg:
        lr: float
        color: Color = Color.RED

        def double(self):
            return Cfg(self.lr * 2, self.color)

    return Cfg(0.25, Color.BLUE), Color


def test_fresh_interpreter_round_trip(tmp_path, protocol):
    def sub():
        return xml.etree.ElementTree.Comment("hi").tag is xml.etree.ElementTree.Comment

    payload = pickling.dumps(
        {
            "closures": _make_closures(),
            "wrapper": fx_model.h,
            "uses_h": fx_model.uses_h,
            "lambda": fx_model.mod_lambda,
            "partial": functools.partial(lambda a, b: a * b, 6),
            "sub": sub,
            "classes": _make_classes(),
        },
        protocol=protocol,
    )
    check = """
    inc, get, fact, empty = obj["closures"]
    inc(); inc()
    try:
        empty()
        empty_raises = False
    except NameError:
        empty_raises = True
    cfg, Color = obj["classes"]
    result = {
        "shared": get(), "fact": fact(5), "empty_raises": empty_raises,
        "wrapper": obj["wrapper"](2), "qualname": obj["wrapper"].__qualname__,
        "uses_h": obj["uses_h"](2), "lambda": obj["lambda"](5), "partial": obj["partial"](7),
        "had_etree": had_etree, "sub": obj["sub"](),
        "cfg": [cfg.double().lr, cfg.color.name, cfg.color is Color.BLUE],
    }
    """
    pre = 'had_etree = "xml.etree" in sys.modules'
    got = load_in_child(payload, check, cwd=tmp_path, path=[str(ROOT)], pre=pre)
    assert got == {
        "shared": 2,
        "fact": 120,
        "empty_raises": True,
        "wrapper": fx_model.h(2),
        "qualname": "base",
        "uses_h": fx_model.uses_h(2),
        "lambda": 15,
        "partial": 42,
        "had_etree": False,
        "sub": True,
        "cfg": [0.5, "BLUE", True],
    }


def test_main_closures_and_lambdas_reach_a_plain_loader(tmp_path, protocol):
    # What cadence.launch does: the driver is a script (__main__), the rank loads with
    # plain pickle.loads in another interpreter.
    producer = """
    import sys
    from cadence import pickling
    SCALE = 7
    def helper(x):
        return x * SCALE
    def make(k):
        def step(x):
            return helper(x) + k
        return step
    lam = lambda x: helper(x) - 1
    class Acc:
        def __init__(self):
            self.total = 0
        def add(self, x):
            self.total += x
            return self.total
    sys.stdout.buffer.write(pickling.dumps((make(3), lam, Acc().add, helper), protocol=PROTO))
    """.replace("PROTO", str(protocol))
    payload = run_python(producer, cwd=tmp_path).stdout
    got = load_in_child(
        payload,
        "step, lam, add, helper = obj\nresult = [step(1), lam(1), add(2), add(3), helper.__module__]",
        cwd=tmp_path,
    )
    assert got == [10, 6, 2, 5, "__main__"]


def test_test_module_closures_for_launch(tmp_path, protocol):
    # Closures and lambdas defined in a test module; the rank has the driver's sys.path.
    k = 5
    lam = lambda x: x + k  # noqa: E731

    def closure(x):
        return _make_closures()[2](x) + k

    payload = pickling.dumps((lam, closure), protocol=protocol)
    got = load_in_child(payload, "result = [obj[0](1), obj[1](3)]", cwd=tmp_path, path=[str(ROOT)])
    assert got == [6, 11]


def test_harness_detects_a_wrong_value(tmp_path):
    # The harness must be able to fail: a wrong expectation does not pass.
    got = load_in_child(pickling.dumps(lambda: 41), "result = obj()", cwd=tmp_path)
    assert got != 42 and json.loads(json.dumps(got)) == 41


def test_dynamic_class_loaded_twice_is_one_class_in_the_child(tmp_path, protocol):
    def make():
        class Item:
            def __init__(self, v):
                self.v = v

        return Item

    item_cls = make()
    first = pickling.dumps(item_cls(1), protocol=protocol)
    second = pickling.dumps(item_cls(2), protocol=protocol)
    check = f"""
    a = obj
    b = pickle.loads({second!r})
    result = [type(a) is type(b), isinstance(b, type(a)), a.v, b.v, type(a).__qualname__]
    """
    got = load_in_child(first, check, cwd=tmp_path)
    assert got == [True, True, 1, 2, item_cls.__qualname__]


def test_importable_and_working_without_torch_or_numpy(tmp_path):
    code = """
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("torch", "numpy"):
                raise ImportError(f"{name} is blocked in this test")

    sys.meta_path.insert(0, Block())
    import pickle
    import cadence.pickling as cp
    k = 3
    data = cp.dumps([lambda x: x + k, memoryview(b"ab"), {1: 2}.keys()])
    f, view, keys = pickle.loads(data)
    assert f(1) == 4 and view.tobytes() == b"ab" and list(keys) == [1]
    assert "torch" not in sys.modules and "numpy" not in sys.modules
    print("ok")
    """
    out = run_python(code, cwd=tmp_path, light=False).stdout.decode().strip()
    assert out == "ok"
