"""Functions and closures by value: cells, slots, globals, wrappers (B1-B18, B22-B27).

Each test round-trips through ``cadence.pickling.dumps`` and the *standard*
``pickle.loads`` under protocols 4 and 5, and compares real values. The labels (B1...)
are the rows of the behaviour table in docs/pickling.md.
"""

import builtins
import functools
import math
import operator
import pickle
import sys
import threading
import types
import typing

import pytest

from cadence import pickling
from tests.pickling._harness import rt, rt_rebuilt
from tests.pickling.fixtures import fx_decorators, fx_model, fx_relative, fx_shared

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free

_GLOBAL = "default_value"


# B1 / B2 / B3: cells ---------------------------------------------------------------------
def test_b1_empty_cell_stays_empty(protocol):
    def make():
        if False:
            unset = 1

        def f():
            return unset

        return f

    f = rt(make(), protocol)
    with pytest.raises(NameError):
        f()
    assert f.__closure__[0] is not None


def test_b1_cell_holding_none_is_not_empty_and_no_closure_stays_none(protocol):
    def make():
        value = None

        def f():
            return value

        return f

    def no_closure():
        return 1

    assert rt(make(), protocol)() is None
    assert rt(no_closure, protocol).__closure__ is None


def test_b2_recursive_closure_terminates(protocol):
    def make(base):
        def fact(n):
            return base if n <= 1 else n * fact(n - 1)

        def me():
            return me

        return fact, me

    fact, me = rt(make(2), protocol)
    assert fact(5) == 240
    assert me() is me


def test_b3_shared_cell_stays_shared(protocol):
    def make():
        c = 0

        def inc():
            nonlocal c
            c += 1
            return c

        def get():
            return c

        return inc, get

    inc, get = rt(make(), protocol)
    inc()
    inc()
    assert get() == 2
    assert inc.__closure__[0] is get.__closure__[0]


def test_lambdas_nested_and_unhashable_cell_contents(protocol):
    a, b = 1, 2
    f1 = lambda x: x + a  # noqa: E731
    f2 = lambda x: f1(x) // b  # noqa: E731
    s = {1, 2}
    assert rt(f2, protocol)(1) == 1
    assert rt(lambda: len(s), protocol)() == 2


# B4 / B5: defaults -----------------------------------------------------------------------
def test_b4_b5_defaults_kwonly_and_posonly(protocol):
    def make():
        def f(a, /, b=3, *, k=2):
            return a + b * k

        return f

    f = rt(make(), protocol)
    assert (f.__defaults__, f.__kwdefaults__) == ((3,), {"k": 2})
    assert f(1) == 7 and f(1, 1, k=10) == 11
    assert f.__code__.co_posonlyargcount == 1
    with pytest.raises(TypeError):
        f(a=1)


@pytest.mark.parametrize("slot", ["kwdefault", "default"])
def test_b4_b5_unpicklable_default_fails_loudly(protocol, slot):
    def make():
        if slot == "kwdefault":

            def f(*, lock=threading.Lock()):  # noqa: B008
                return lock
        else:

            def f(x=threading.Lock()):  # noqa: B008
                return x

        return f

    where = r"__kwdefaults__\['lock'\]" if slot == "kwdefault" else r"__defaults__\[0\]"
    with pytest.raises(TypeError, match=where):
        pickling.dumps(make(), protocol=protocol)


# B6 / B7 / B8 / B9 / B11: optional slots ------------------------------------------------------
def test_b6_unpicklable_dict_entry_pruned_with_warning(protocol):
    def make():
        def h(x):
            return x * h.tag

        h.tag = 2.0
        h.lock = threading.Lock()
        h.me = h
        return h

    with pytest.warns(pickling.PrunedSlotWarning, match=r"h\.lock \(lock\)"):
        h = rt(make(), protocol)
    assert h.tag == 2.0 and h.me is h and h(3) == 6.0
    assert not hasattr(h, "lock")


def test_b7_wrapped_dragging_a_lock_is_pruned_inside(protocol):
    def make():
        def base(x):
            return x + 1

        base.lock = threading.Lock()

        @functools.wraps(base)
        def w(x):
            return base(x) * 2

        return w

    with pytest.warns(pickling.PrunedSlotWarning) as record:
        w = rt(make(), protocol)
    assert "lock" in " ".join(str(r.message) for r in record)
    assert w(1) == 4 and not hasattr(w, "lock")
    # The innermost failing edge is pruned, so __wrapped__ survives without its lock.
    assert w.__wrapped__(1) == 2 and not hasattr(w.__wrapped__, "lock")


def test_b8_doc_assigned_kept_and_unpicklable_doc_dropped(protocol):
    def make(doc):
        def inner():
            """Inner doc."""
            return 5

        inner.__doc__ = doc
        return inner

    assert rt(make("assigned doc"), protocol).__doc__ == "assigned doc"
    with pytest.warns(pickling.PrunedSlotWarning, match=r"__doc__"):
        inner = rt(make(threading.Lock()), protocol)
    assert inner.__doc__ is None and inner() == 5


def test_b9_annotations_local_class_kept_unpicklable_one_pruned(protocol):
    def make():
        class Cfg:
            pass

        def inner(x: Cfg, y: int) -> int:
            return y

        def other(x: int):
            return x

        other.__annotations__["bad"] = threading.Lock()
        return inner, other

    inner = rt_rebuilt(make()[0], protocol)
    assert inner.__annotations__["x"].__name__ == "Cfg"
    assert (inner.__annotations__["y"], inner.__annotations__["return"]) == (int, int)
    with pytest.warns(pickling.PrunedSlotWarning, match="__annotations__"):
        other = rt(make()[1], protocol)
    assert other.__annotations__ == {"x": int}


@pytest.mark.skipif(sys.version_info < (3, 14), reason="PEP 649 lazy annotations are 3.14+")
def test_b10_lazy_annotations(protocol):  # pragma: no cover - runs on 3.14 only
    ns: dict = {}
    exec("def inner(x: Missing) -> int: return 1", ns)
    assert rt(ns["inner"], protocol)() == 1


def test_b11_type_params_carried(protocol):
    def make():
        T = typing.TypeVar("T")

        def ident(x):
            return x

        # 3.12+ has the slot; on 3.11 the attribute lives in __dict__, carried too.
        ident.__type_params__ = (T,)
        return ident

    ident = rt(make(), protocol)
    assert [t.__name__ for t in ident.__type_params__] == ["T"] and ident(3) == 3


# B12 / B13 / B14 / B15: names and modules ------------------------------------------------
def test_b12_qualname_default_and_mutated(protocol):
    def q():
        return 1

    assert rt(q, protocol).__qualname__ == q.__qualname__
    q.__qualname__ = "custom.qual"
    assert q.__qualname__ != q.__code__.co_qualname
    assert rt(q, protocol).__qualname__ == "custom.qual"


def test_b13_wraps_keeps_name_qualname_doc_annotations(protocol):
    def f(x: int) -> float:
        """42"""

    @functools.wraps(f)
    def g(x):
        return f(x)

    g2 = rt(g, protocol)
    assert (g2.__name__, g2.__doc__, g2.__annotations__) == ("f", "42", f.__annotations__)
    h = rt(fx_model.h, protocol)
    assert (h.__qualname__, h.__name__, h.__doc__) == ("base", "base", "Base docstring.")
    assert h(1) == (1 + 1) * fx_decorators.SCALE


@pytest.mark.parametrize("module", [None, "no_such_module_anywhere", 42, "__main__"])
def test_b14_module_none_nonstr_or_unimportable(protocol, module):
    ns: dict = {"__name__": "exec_scope"}
    exec("def f(x):\n    return x * 2\n", ns)
    f = ns["f"]
    f.__module__ = module
    g = rt(f, protocol)
    assert g.__module__ == module and g(4) == 8


def test_b14_function_module_name_kept(protocol):
    def local_func(x):
        return x

    for func in (local_func, lambda x: x):
        assert rt(func, protocol).__module__ == func.__module__


def test_b15_identity_decides_by_reference(protocol):
    # A module-level wraps wrapper claims fx_model.base's name but is another object.
    assert b"_make_function" in pickling.dumps(fx_model.h, protocol=protocol)
    assert rt(fx_model.base, protocol) is fx_model.base
    assert b"_make_function" not in pickling.dumps(fx_model.base, protocol=protocol)


def test_b25_module_level_lambda_by_value(protocol):
    assert b"_make_function" in pickling.dumps(fx_model.mod_lambda, protocol=protocol)
    assert rt(fx_model.mod_lambda, protocol)(4) == 12


# B16 / B17 / B18: globals -----------------------------------------------------------------
def test_b16_globals_from_compile_scope_only_referenced(protocol):
    data = pickling.dumps(fx_model.h, protocol=protocol)
    h = pickle.loads(data)
    assert h.__globals__["__name__"] == "tests.pickling.fixtures.fx_decorators"
    assert h.__globals__["SCALE"] == fx_decorators.SCALE and h(2) == 9
    assert "BIG_UNRELATED" not in h.__globals__ and "functools" not in h.__globals__
    assert len(data) < 2000  # BIG_UNRELATED (100k ints) must not travel


def test_b16_nested_code_globals_only(protocol):
    def nested_function(x):
        return x + 1

    def unwanted_function(x):
        return math.exp(x)

    def my_small_function(x, y):
        return nested_function(x) + y

    data = pickling.dumps(my_small_function, protocol=protocol)
    assert b"nested_function" in data
    assert b"unwanted_function" not in data and b"math" not in data
    ns: dict = {"__name__": "scope", "NESTED_G": 5, "UNUSED": list(range(1000))}
    exec("def outer():\n    def inner():\n        return NESTED_G\n    return inner()\n", ns)
    f = rt(ns["outer"], protocol)
    assert f() == 5 and "NESTED_G" in f.__globals__ and "UNUSED" not in f.__globals__


def test_b16_name_shadowing_a_builtin_is_not_a_global(protocol):
    class Unpicklable:
        def __reduce__(self):
            raise Exception("not picklable")

    ns: dict = {"__name__": "scope", "exit": Unpicklable(), "sys": sys}
    exec("def foo():\n    sys.exit(0)\n", ns)  # `exit` is an attribute here, not a global
    assert "exit" in ns["foo"].__code__.co_names
    assert callable(rt(ns["foo"], protocol))


def test_b17_one_payload_shares_one_isolated_namespace(protocol):
    global _GLOBAL

    def f0():
        global _GLOBAL
        _GLOBAL = "changed_by_f0"

    def f1():
        return _GLOBAL

    cloned_f0, cloned_f1 = rt([f0, f1], protocol)
    assert cloned_f0.__globals__ is cloned_f1.__globals__
    assert cloned_f0.__globals__ is not f0.__globals__
    pickled_f1 = pickling.dumps(f1, protocol=protocol)
    cloned_f0()
    assert _GLOBAL == "default_value"  # the live module is untouched
    assert cloned_f1() == "changed_by_f0"  # same payload: same namespace
    new_f1 = pickle.loads(pickled_f1)  # another payload: another namespace
    assert new_f1.__globals__ is not cloned_f1.__globals__ and new_f1() == "default_value"


def test_b17_module_functions_share_one_rebuilt_dict(protocol):
    pickling.register_pickle_by_value(fx_shared)
    try:
        bump, read = rt((fx_shared.bump, fx_shared.read), protocol)
    finally:
        pickling.unregister_pickle_by_value(fx_shared)
    assert bump.__globals__ is read.__globals__ is not fx_shared.__dict__
    before = fx_shared.COUNTER[0]
    bump()
    assert read() == before + 1 and fx_shared.COUNTER[0] == before


def test_b17_recursion_through_globals_and_mutual_pair(protocol):
    ns: dict = {"__name__": "not_importable_scope"}
    exec(
        "def fact(n):\n    return 1 if n <= 1 else n * fact(n - 1)\n"
        "def is_even(n):\n    return True if n == 0 else is_odd(n - 1)\n"
        "def is_odd(n):\n    return False if n == 0 else is_even(n - 1)\n",
        ns,
    )
    fact, is_even = rt((ns["fact"], ns["is_even"]), protocol)
    assert fact(5) == 120 and is_even(10) is True and is_even(7) is False
    assert fact.__globals__ is is_even.__globals__


def test_b18_builtins_are_the_real_module(protocol):
    def f():
        return sum(range(10)), len("abc")

    g = rt(f, protocol)
    assert g() == (45, 3) and g.__globals__["__builtins__"] is builtins


def test_relative_import_inside_function(protocol):
    f2, g2 = rt(fx_relative.factory(), protocol)
    assert (f2(), g2()) == ("hello from a module!", "hello from a package!")


@functools.cache
def _function_with_65k_globals():
    # More than 65535 globals: LOAD_GLOBAL needs two EXTENDED_ARG prefixes.
    names = [f"g{i}" for i in range(1, 65537 + 258)]
    d = {name: i % 100 for i, name in enumerate(names)}
    exec(f"def f():\n    return sum(({', '.join(names)}))\n", d)
    return d["f"]


def test_extended_arg_globals(protocol):
    f = _function_with_65k_globals()
    f2, f3 = rt([f, f], protocol)
    assert f2 is f3 and f2() == f()


def test_global_name_scan_agrees_with_dis():
    # The fast bytecode scan (see [Note: scanning bytecode]) against dis, on every code
    # object of a few stdlib modules and on a function whose globals need EXTENDED_ARG.
    # (test_extended_arg_globals covers two prefixes by calling the loaded function.)
    import dataclasses
    import dis
    import json.decoder
    import typing as typing_module

    from cadence.pickling import _lookup

    ops = {"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL"}

    def codes(obj, out):
        for v in vars(obj).values():
            if isinstance(v, types.FunctionType) and v.__code__ not in out:
                out.append(v.__code__)
            elif isinstance(v, type) and v.__module__ == obj.__name__:
                for m in vars(v).values():
                    if isinstance(m, types.FunctionType):
                        out.append(m.__code__)
        return out

    names = [f"h{i}" for i in range(300)]
    ns: dict = {}
    exec(f"def f():\n    global h299\n    h299 = 1\n    return ({', '.join(names)})\n", ns)
    all_codes = [ns["f"].__code__]
    for module in (dataclasses, json.decoder, typing_module, functools):
        codes(module, all_codes)
    assert len(all_codes) > 300
    for code in all_codes:
        expected: dict = {}
        for sub in _lookup._nested_codes(code):
            for instr in dis.get_instructions(sub):
                if instr.opname in ops:
                    expected.setdefault(instr.argval, None)
        assert _lookup.code_global_names(code) == tuple(expected), code.co_qualname


# B22 / B23 / B26: methods, partials, callables ---------------------------------------------
def test_b22_bound_methods_hand_built_and_partial_as_func(protocol):
    class State:
        def __init__(self):
            self.n = 3

    def on_step(self, k):
        return self.n * k

    class R:
        pass

    m = rt(types.MethodType(on_step, State()), protocol)
    assert isinstance(m, types.MethodType) and m(2) == 6
    p = rt(types.MethodType(functools.partial(lambda a, s: (a, type(s).__name__), 1), R()),
           protocol)  # fmt: skip
    assert p() == (1, "R")


def test_b23_property_named_like_the_method_is_not_run(protocol):
    calls = []

    def step(self):
        return "method"

    class Receiver:
        @property
        def step(self):
            calls.append(1)
            return lambda: "property"

    assert rt(types.MethodType(step, Receiver()), protocol)() == "method"
    assert calls == []


def test_b26_partials_and_stdlib_callables(protocol):
    def add(a, b):
        return a + b

    class C:
        def __getattr__(self, item):
            return item

    assert rt(functools.partial(add, 1), protocol)(2) == 3
    assert rt(functools.partial(min, 1), protocol)(4) == 1
    assert rt(operator.itemgetter(0, 3), protocol)(range(10)) == (0, 3)
    assert rt(operator.attrgetter("e.a", "b"), protocol)(types.SimpleNamespace(e=C(), b=1)) \
        == ("a", 1)  # fmt: skip
    assert rt({"a": 1}.get, protocol)("a") == 1


def test_builtin_functions_and_methods_by_reference(protocol):
    import os

    obj = 1.5
    assert rt(zip, protocol) is zip and rt(os.mkdir, protocol) is os.mkdir
    assert rt(str.upper, protocol)("abc") == "ABC"
    assert rt(obj.hex, protocol)() == obj.hex()
    assert rt(float.hex, protocol) is float.hex
    assert rt(float.__repr__, protocol) is float.__repr__
    assert rt(obj.__repr__, protocol)() == "1.5"
    assert rt(float.fromhex, protocol)("0x1") == 1.0
    assert rt("foo".maketrans, protocol) is str.maketrans
    for t in (list, tuple, set, frozenset, dict, object):
        assert isinstance(rt(t.__new__, protocol)(t), t)


def test_generator_function_classmethod_and_staticmethod_objects(protocol):
    def some_generator(cnt):
        yield from range(cnt)

    class A:
        @staticmethod
        def sm():
            return "sm"

        @classmethod
        def cm(cls):
            return "cm"

    gen2 = rt(some_generator, protocol)
    assert list(gen2(3)) == [0, 1, 2]
    sm, cm = rt((A.__dict__["sm"], A.__dict__["cm"]), protocol)
    assert type(sm) is staticmethod and type(cm) is classmethod
    A.sm2, A.cm2 = sm, cm
    assert (A.sm2(), A.cm2()) == ("sm", "cm")
    assert rt(A.cm, protocol)() == "cm"  # bound classmethod
    assert rt(A.__dict__["sm"].__func__, protocol)() == "sm"


def test_shared_cell_through_a_wraps_wrapper(protocol):
    def make():
        state = {"calls": 0}

        def base(x):
            state["calls"] += 1
            return x

        @functools.wraps(base)
        def wrapper(x):
            return base(x) + state["calls"]

        def calls():
            return state["calls"]

        return wrapper, calls

    wrapper, calls = rt(make(), protocol)
    assert wrapper(10) == 11 and wrapper.__wrapped__(0) == 0 and calls() == 2
