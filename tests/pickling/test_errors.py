"""Errors (B24, B29): every refusal names the path to the offending object, keeps the
error type a caller of the standard pickler expects, and derives from CadenceError."""

import pickle
import sys
import threading
import types

import pytest

from cadence import pickling
from cadence.errors import CadenceError

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free


class RaiserOnPickle:
    def __init__(self, exc):
        self.exc = exc

    def __reduce__(self):
        raise self.exc


@pytest.mark.parametrize(
    ("error", "bases"),
    [
        (pickling.UnpicklableError, (pickle.PicklingError, TypeError)),
        (pickling.RecursionDepthError, (pickle.PicklingError,)),
        (pickling.EnvelopeError, (pickle.UnpicklingError,)),
        (pickling.SignatureError, (pickling.EnvelopeError,)),
        (pickling.IncompatiblePayloadError, (pickling.EnvelopeError,)),
        (pickling.ForbiddenGlobalError, (pickle.UnpicklingError,)),
    ],
)
def test_errors_derive_from_cadence_error_and_the_pickle_error(error, bases):
    assert issubclass(error, CadenceError)
    for base in bases:
        assert issubclass(error, base)


def test_forbidden_global_error_survives_pickling(protocol):
    err = pickling.ForbiddenGlobalError("refused 'os.system'", "os.system")
    back = pickle.loads(pickling.dumps(err, protocol=protocol))
    assert (str(back), back.global_name) == ("refused 'os.system'", "os.system")


# B24 -------------------------------------------------------------------------------------
def _frames_and_friends():
    def gen():
        yield 1

    async def coro():
        return 1

    async def agen():
        yield 1

    try:
        raise ValueError
    except ValueError as e:
        tb = e.__traceback__
    return {"generator": gen(), "coroutine": coro(), "async_generator": agen(),
            "frame": sys._getframe(), "traceback": tb}  # fmt: skip


@pytest.mark.parametrize("kind", ["generator", "coroutine", "async_generator", "frame",
                                  "traceback"])  # fmt: skip
def test_b24_live_frames_refused_with_reason_and_path(protocol, kind):
    objs = _frames_and_friends()
    value = objs[kind]

    def f():
        return value

    try:
        with pytest.raises(pickling.UnpicklableError, match=rf"{kind}.*__closure__\['value'\]"):
            pickling.dumps(f, protocol=protocol)
    finally:
        for o in objs.values():
            if hasattr(o, "close") and not isinstance(o, types.AsyncGeneratorType):
                o.close()


# B29 -------------------------------------------------------------------------------------
def test_b29_error_names_path_and_keeps_type(protocol):
    def make():
        cfg = types.SimpleNamespace(lock=threading.Lock(), bad=None)

        def fn():
            return cfg

        return fn

    with pytest.raises(
        TypeError, match=r"reached via \S*make\.<locals>\.fn\.__closure__\['cfg'\]\.lock"
    ):
        pickling.dumps(make(), protocol=protocol)
    with pytest.raises(ValueError, match=r"no way \(reached via obj\['k'\]\[1\]\)"):
        pickling.dumps({"k": [1, RaiserOnPickle(ValueError("no way"))]}, protocol=protocol)


@pytest.mark.parametrize("exc_type", [Exception, ValueError, TypeError, RuntimeError])
def test_b29_user_reduce_error_reraised_with_its_type(protocol, exc_type):
    with pytest.raises(exc_type, match="foo"):
        pickling.dumps(RaiserOnPickle(exc_type("foo")), protocol=protocol)


def test_b29_recursion_error_becomes_recursion_depth_error_naming_the_path(protocol):
    deep: list = []
    node = deep
    for _ in range(sys.getrecursionlimit() * 4):
        node.append([])
        node = node[0]
    with pytest.raises(pickling.RecursionDepthError, match="recursion limit") as info:
        pickling.dumps({"deep": deep}, protocol=protocol)
    message = str(info.value)
    assert isinstance(info.value.__cause__, RecursionError)
    assert "reached via obj['deep'][0][0]" in message and "more steps" in message


def test_b29_recursion_inside_a_user_getattribute(protocol):
    class A:
        def __getattribute__(self, name):
            return getattr(self, name)

    with pytest.raises(pickle.PicklingError, match=r"recursion limit.*reached via obj\[1\]"):
        pickling.dumps([1, A()], protocol=protocol)


def test_prune_warning_names_the_slot_and_the_remedy(protocol):
    def h():
        return 1

    h.lock = threading.Lock()
    with pytest.warns(pickling.PrunedSlotWarning) as record:
        pickling.dumps(h, protocol=protocol)
    (warning,) = record
    message = str(warning.message)
    assert "dropped" in message and "h.lock (lock)" in message
    assert "make it picklable or delete it" in message


def test_pruning_restarts_once_per_pruned_slot_not_per_path(protocol, monkeypatch):
    from cadence.pickling import _pickler

    def make(i):
        def f():
            return i

        return f

    funcs = [make(i) for i in range(8)]
    for f in funcs:
        for j, g in enumerate(funcs):
            setattr(f, f"peer{j}", g)
    funcs[3].lock = threading.Lock()
    walks = []
    real = _pickler.find_path
    monkeypatch.setattr(_pickler, "find_path", lambda *a: walks.append(1) or real(*a))
    with pytest.warns(pickling.PrunedSlotWarning):
        loaded = pickle.loads(pickling.dumps(funcs, protocol=protocol))
    assert len(walks) == 1  # one failure, one walk, one restart
    assert [f() for f in loaded] == list(range(8))
    assert loaded[0].peer5 is loaded[5] and not hasattr(loaded[3], "lock")
