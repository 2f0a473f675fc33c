"""Behaviours B1-B18 of the design table, in process (B19-B29: test_objects.py).

Each test round-trips through ``cadence.pickling.dumps`` and the *standard*
``pickle.loads`` and compares real values. The fresh-interpreter versions of the
behaviours where the process boundary matters are in test_subprocess.py.
"""

import functools
import pickle
import sys
import threading
import typing
import warnings

import pytest

from cadence import pickling
from tests.pickling.fixtures import fx_decorators, fx_model, fx_shared


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


# B1 ------------------------------------------------------------------------------------
def test_b1_empty_cell_stays_empty():
    def make():
        if False:
            unset = 1

        def f():
            return unset

        return f

    f = rt(make())
    with pytest.raises(NameError):
        f()
    assert f.__closure__[0] is not None


def test_b1_cell_holding_none_is_not_empty():
    def make():
        value = None

        def f():
            return value

        return f

    assert rt(make())() is None


# B2 ------------------------------------------------------------------------------------
def test_b2_recursive_closure_terminates():
    def make():
        def fact(n):
            return 1 if n <= 1 else n * fact(n - 1)

        def me():
            return me

        return fact, me

    fact, me = rt(make())
    assert fact(6) == 720
    assert me() is me


# B3 ------------------------------------------------------------------------------------
def test_b3_shared_cell_stays_shared():
    def make():
        c = 0

        def inc():
            nonlocal c
            c += 1
            return c

        def get():
            return c

        return inc, get

    inc, get = rt(make())
    inc()
    inc()
    assert get() == 2
    assert inc.__closure__[0] is get.__closure__[0]


# B4 / B5 -------------------------------------------------------------------------------
def test_b4_b5_defaults_and_kwdefaults():
    def make():
        def f(a, b=3, *, k=2):
            return a + b * k

        return f

    f = rt(make())
    assert f.__defaults__ == (3,)
    assert f.__kwdefaults__ == {"k": 2}
    assert f(1) == 7
    assert f(1, 1, k=10) == 11


def test_b4_lock_kwdefault_fails_loudly():
    def make():
        def f(*, lock=threading.Lock()):  # noqa: B008
            return lock

        return f

    with pytest.raises(TypeError, match=r"__kwdefaults__\['lock'\]"):
        pickling.dumps(make())


def test_b5_lock_default_fails_loudly():
    def make():
        def f(x=threading.Lock()):  # noqa: B008
            return x

        return f

    with pytest.raises(TypeError, match=r"__defaults__\[0\]"):
        pickling.dumps(make())


# B6 ------------------------------------------------------------------------------------
def test_b6_unpicklable_dict_entry_pruned_with_warning():
    def make():
        def h(x):
            return x * h.tag

        h.tag = 2.0
        h.lock = threading.Lock()
        return h

    with pytest.warns(pickling.PrunedSlotWarning, match=r"h\.lock \(lock\)"):
        h = rt(make())
    assert h.tag == 2.0
    assert not hasattr(h, "lock")
    assert h(3) == 6.0


def test_b6_self_reference_in_dict_terminates():
    def make():
        def w():
            return 1

        w.me = w
        return w

    w = rt(make())
    assert w.me is w


# B7 ------------------------------------------------------------------------------------
def test_b7_wrapped_dragging_a_lock_is_pruned_inside():
    def make():
        def base(x):
            return x + 1

        base.lock = threading.Lock()

        @functools.wraps(base)
        def w(x):
            return base(x) * 2

        return w

    with pytest.warns(pickling.PrunedSlotWarning) as record:
        w = rt(make())
    messages = " ".join(str(r.message) for r in record)
    assert "lock" in messages
    assert w(1) == 4
    assert not hasattr(w, "lock")
    # The innermost failing edge is pruned, so __wrapped__ itself survives without its lock.
    assert w.__wrapped__(1) == 2
    assert not hasattr(w.__wrapped__, "lock")


# B8 ------------------------------------------------------------------------------------
def test_b8_unpicklable_doc_dropped_to_none():
    def make():
        def inner():
            return 5

        inner.__doc__ = threading.Lock()
        return inner

    with pytest.warns(pickling.PrunedSlotWarning, match=r"__doc__"):
        inner = rt(make())
    assert inner.__doc__ is None
    assert inner() == 5


def test_b8_string_doc_kept():
    def make():
        def inner():
            """Inner doc."""

        inner.__doc__ = "assigned doc"
        return inner

    assert rt(make()).__doc__ == "assigned doc"


# B9 ------------------------------------------------------------------------------------
def test_b9_annotations_naming_a_local_class():
    def make():
        class Cfg:
            pass

        def inner(x: Cfg, y: int) -> int:
            return y

        return inner

    inner = rt_rebuilt(make())
    assert inner.__annotations__["x"].__name__ == "Cfg"
    assert inner.__annotations__["y"] is int
    assert inner.__annotations__["return"] is int


def test_b9_unpicklable_annotation_pruned():
    def make():
        def inner(x: int):
            return x

        inner.__annotations__["bad"] = threading.Lock()
        return inner

    with pytest.warns(pickling.PrunedSlotWarning, match="__annotations__"):
        inner = rt(make())
    assert inner.__annotations__ == {"x": int}


# B10 -----------------------------------------------------------------------------------
@pytest.mark.skipif(sys.version_info < (3, 14), reason="PEP 649 lazy annotations are 3.14+")
def test_b10_lazy_annotations():  # pragma: no cover - runs on 3.14 only
    ns: dict = {}
    exec("def inner(x: Missing) -> int: return 1", ns)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert rt(ns["inner"])() == 1


# B11 -----------------------------------------------------------------------------------
def test_b11_type_params_carried():
    def make():
        T = typing.TypeVar("T")

        def ident(x):
            return x

        # 3.12+ has the slot; on 3.11 the attribute lives in __dict__, which is carried too.
        ident.__type_params__ = (T,)
        return ident

    ident = rt(make())
    assert [t.__name__ for t in ident.__type_params__] == ["T"]
    assert ident(3) == 3


def test_b11_local_typevar_by_value():
    def make():
        return typing.TypeVar("U", bound=int)

    u = rt(make())
    assert u.__name__ == "U" and u.__bound__ is int


# B12 / B13 -----------------------------------------------------------------------------
def test_b12_custom_qualname():
    def make():
        def q():
            return 1

        q.__qualname__ = "custom.qual"
        return q

    q = make()
    assert q.__qualname__ != q.__code__.co_qualname
    assert rt(q).__qualname__ == "custom.qual"


def test_b13_wraps_assigned_qualname_and_name():
    h = rt(fx_model.h)
    assert h.__qualname__ == "base"
    assert h.__name__ == "base"
    assert h.__doc__ == "Base docstring."
    assert h(1) == (1 + 1) * fx_decorators.SCALE


# B14 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("module", [None, "no_such_module_anywhere", 42])
def test_b14_module_none_nonstr_or_unimportable(module):
    ns: dict = {"__name__": "exec_scope"}
    exec("def f(x):\n    return x * 2\n", ns)
    f = ns["f"]
    f.__module__ = module
    g = rt(f)
    assert g.__module__ == module
    assert g(4) == 8


# B15 -----------------------------------------------------------------------------------
def test_b15_module_level_wraps_wrapper_goes_by_value():
    data = pickling.dumps(fx_model.h)
    assert b"_make_function" in data
    assert pickle.loads(pickling.dumps(fx_model.base)) is fx_model.base  # by reference


# B16 -----------------------------------------------------------------------------------
def test_b16_globals_from_compile_scope_only_referenced():
    data = pickling.dumps(fx_model.h)
    h = pickle.loads(data)
    assert h.__globals__["__name__"] == "tests.pickling.fixtures.fx_decorators"
    assert h.__globals__["SCALE"] == fx_decorators.SCALE
    assert "BIG_UNRELATED" not in h.__globals__ and "functools" not in h.__globals__
    assert h(2) == 9
    assert len(data) < 2000  # BIG_UNRELATED (100k ints) must not travel


def test_b16_nested_code_globals_only():
    ns: dict = {"__name__": "scope", "NESTED_G": 5, "UNUSED": list(range(1000))}
    exec("def outer():\n    def inner():\n        return NESTED_G\n    return inner()\n", ns)
    f = rt(ns["outer"])
    assert f() == 5
    assert "NESTED_G" in f.__globals__
    assert "UNUSED" not in f.__globals__


# B17 -----------------------------------------------------------------------------------
def test_b17_functions_of_one_module_share_one_rebuilt_dict():
    pickling.register_pickle_by_value(fx_shared)
    try:
        bump, read = rt((fx_shared.bump, fx_shared.read))
    finally:
        pickling.unregister_pickle_by_value(fx_shared)
    assert bump.__globals__ is read.__globals__
    assert bump.__globals__ is not fx_shared.__dict__
    before = fx_shared.COUNTER[0]
    bump()
    assert read() == before + 1
    assert fx_shared.COUNTER[0] == before  # isolated from the live module


# B18 -----------------------------------------------------------------------------------
def test_b18_builtins_are_the_real_module():
    import builtins

    def make():
        def f():
            return sum(range(10)), len("abc")

        return f

    f = rt(make())
    assert f() == (45, 3)
    assert f.__globals__["__builtins__"] is builtins




# Regressions from the PyTorch stack ----------------------------------------------------
def test_recursion_through_globals_and_mutual_pair_terminate():
    ns: dict = {"__name__": "not_importable_scope"}
    exec(
        "def fact(n):\n    return 1 if n <= 1 else n * fact(n - 1)\n"
        "def is_even(n):\n    return True if n == 0 else is_odd(n - 1)\n"
        "def is_odd(n):\n    return False if n == 0 else is_even(n - 1)\n",
        ns,
    )
    fact, is_even = rt((ns["fact"], ns["is_even"]))
    assert fact(5) == 120
    assert is_even(10) is True and is_even(7) is False
    assert fact.__globals__ is is_even.__globals__


def test_clique_of_functions_in_dicts_is_linear():
    import time

    def make(i):
        def f():
            return i

        return f

    funcs = [make(i) for i in range(8)]
    for f in funcs:
        for j, g in enumerate(funcs):
            setattr(f, f"peer{j}", g)
    funcs[3].lock = threading.Lock()  # one prune: one restart, not one per path
    t0 = time.perf_counter()
    with pytest.warns(pickling.PrunedSlotWarning):
        loaded = rt(funcs)
    assert time.perf_counter() - t0 < 5.0
    assert [f() for f in loaded] == list(range(8))
    assert loaded[0].peer5 is loaded[5] and not hasattr(loaded[3], "lock")


def test_shared_cell_through_a_wraps_wrapper():
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

    wrapper, calls = rt(make())
    assert wrapper(10) == 11
    assert wrapper.__wrapped__(0) == 0
    assert calls() == 2
