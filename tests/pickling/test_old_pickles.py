"""Compatibility over time (B28): payloads frozen by an earlier cadence still load.

``old_pickles/<impl>_<major><minor>/`` holds payloads written by ``generate.py`` at the
time the set was added; they are never regenerated. Each must load with the standard
``pickle.loads`` and behave as ``CHECKS`` says, or, on another interpreter version, be
refused with ``IncompatiblePayloadError`` (a versioned error that names both versions),
never with a bare ``AttributeError`` or a crash. A reconstructor the frozen payloads
name may not disappear (see [Note: payload format] in ``_reconstructors``).
"""

from __future__ import annotations

import importlib
import pickle
import pickletools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cadence import pickling
from cadence.pickling import _signed
from tests.pickling._harness import fresh_tracker
from tests.pickling.old_pickles.generate import SIGNING_KEY

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free

OLD = Path(__file__).with_name("old_pickles")
HERE = f"{sys.implementation.name}_{sys.version_info[0]}{sys.version_info[1]}"
PAYLOADS = sorted(OLD.glob("*/*.pkl"))
# A loop over a glob passes when the glob finds nothing: the frozen payloads must be here.
assert PAYLOADS, f"no frozen payloads under {OLD}"


def _counter(obj: Any) -> None:
    inc, get = obj
    assert (inc(), inc(5), get()) == (12, 19, 19)
    assert inc.__kwdefaults__ is None and inc.__defaults__ == (0,)
    assert inc.__annotations__ == {"by": int, "return": int}


def _class_instance(obj: Any) -> None:
    point_cls, p = obj
    assert type(p) is point_cls and (p.x, p.y, p.norm1) == (3, -4, 7)
    assert point_cls.origin().norm1 == 0 and point_cls.add(2, 3) == 5
    with pytest.raises(AttributeError):
        p.z = 1  # __slots__ survived


def _enum(obj: Any) -> None:
    color, green = obj
    assert green is color.GREEN and green.shout() == "GREEN" and color(1) is color.RED


def _dataclass(obj: Any) -> None:
    import dataclasses

    assert [f.name for f in dataclasses.fields(obj)] == ["lr", "tags"]
    assert obj.tags == ["a"] and obj.scaled(4) == 2.0 and type(obj).steps == 10


def _abc(obj: Any) -> None:
    shape, square = obj
    assert isinstance(square, shape) and isinstance((), shape) and square.area() == 4
    with pytest.raises(TypeError):
        shape()


def _typing(obj: Any) -> None:
    t, p, user_id, box, box_int = obj
    assert (t.__name__, t.__bound__, p.__name__, user_id(3)) == ("T", int, "P", 3)
    assert box_int.__origin__ is box and box_int.__args__ == (int,)
    assert box(5).item == 5 and box.__parameters__ == (t,)


def _data(obj: Any) -> None:
    keys, items, view, strings, frozen = obj
    assert list(keys) == ["a", "b"] and list(items) == [("x", 1)]
    assert view.format == "i" and view.tolist()[0] == int.from_bytes(bytes(range(4)), "little")
    assert strings == {"a", "b"} and frozen == frozenset({1, 3})


CHECKS: dict[str, Callable[[Any], None]] = {
    "counter": _counter,
    "recursive": lambda fact: fact(6) == 720 or pytest.fail("fact(6) != 720"),
    "wrapper": lambda w: (
        (w(1), w.__name__, w.__doc__) == (6, "base", "Base docstring.")
        or pytest.fail(f"wrapper came back as {(w(1), w.__name__, w.__doc__)}")
    ),
    "class_instance": _class_instance,
    "enum": _enum,
    "dataclass": _dataclass,
    "abc": _abc,
    "typing": _typing,
    "module": lambda m: (
        (m.__name__, m.shift(1)) == ("frozen_dynamic_module", 11)
        or pytest.fail("module came back wrong")
    ),
    "data": _data,
}


def test_there_is_a_frozen_set_for_this_interpreter_and_every_object():
    names = {p.name.split(".")[0] for p in (OLD / HERE).glob("*.pkl")}
    assert names == set(CHECKS) | {"signed"}, f"regenerate a set for {HERE} with generate.py"


@pytest.mark.parametrize("path", PAYLOADS, ids=[f"{p.parent.name}/{p.name}" for p in PAYLOADS])
def test_frozen_payload_loads_and_behaves(path: Path):
    name = path.name.split(".")[0]
    data = path.read_bytes()
    with fresh_tracker():  # as a fresh process would load it
        try:
            obj = (
                pickling.loads_signed(data, SIGNING_KEY) if name == "signed" else pickle.loads(data)
            )
        except pickling.IncompatiblePayloadError as exc:
            # Only a payload from another interpreter may be refused, and it must say so.
            assert path.parent.name != HERE, f"{path.name} refused here: {exc}"
            assert "Python" in str(exc) or "python" in str(exc)
            return
    assert path.parent.name == HERE or name == "data", "code loaded across Python versions"
    (CHECKS["recursive"] if name == "signed" else CHECKS[name])(obj)


def test_frozen_data_loads_under_an_allowlist():
    paths = sorted(OLD.glob("*/data.p*.pkl"))
    assert paths, f"no frozen data payloads under {OLD}"
    for path in paths:
        _data(pickling.loads_restricted(path.read_bytes(), pickling.Allowlist()))


def _globals_named(data: bytes) -> set[tuple[str, str]]:
    """The (module, qualname) pairs a protocol 4/5 payload resolves with STACK_GLOBAL."""
    memo: dict[int, Any] = {}
    recent: list[Any] = [None, None]  # the two values pushed last
    out = set()
    for op, arg, _ in pickletools.genops(data):
        if op.name == "MEMOIZE":
            memo[len(memo)] = recent[-1]
            continue
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"):
            value: Any = arg
        elif op.name in ("BINGET", "LONG_BINGET"):
            value = memo.get(arg)
        elif op.name == "STACK_GLOBAL":
            out.add((recent[-2], recent[-1]))
            value = None
        else:
            value = None
        recent = [recent[-1], value]
    return out


def test_every_global_the_frozen_payloads_name_still_exists():
    missing = []
    for path in PAYLOADS:
        data = path.read_bytes()
        if path.name == "signed.pkl":
            data = data[_signed._HEADER.size : -32]  # the pickle inside the envelope
        names = _globals_named(data)
        assert ("cadence.pickling._reconstructors", "_make_function") in names or (
            path.name.startswith(("data", "typing", "enum"))
        )
        for module, qualname in names:
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part, None)
            if obj is None:
                missing.append(f"{module}.{qualname} ({path.name})")
    assert not missing, (
        "globals named by frozen payloads were renamed or removed; keep them "
        f"(see [Note: payload format]): {sorted(set(missing))}"
    )


def test_b28_code_from_another_python_is_refused_with_a_versioned_error():
    from cadence.pickling import _reconstructors

    with pytest.raises(pickling.IncompatiblePayloadError, match=r"compiled by Python 3\.0"):
        _reconstructors._make_code((3, 0), ())
