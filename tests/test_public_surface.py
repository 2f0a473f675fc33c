"""The public surface of `cadence`, written down: a change to it is a visible decision.

Specification:

- ``tests/public_surface.txt`` lists, one line each, every name in
  ``cadence.__all__`` with its kind and, for a function or class, its signature, and
  for a class every public method and property that cadence defines (what it
  inherits from torch is torch's surface). The test regenerates the list and
  compares: an added, removed or changed entry fails with the difference, and the
  fix is to run ``python -m tests.test_public_surface --write`` and commit the file
  with the change that made it (so the diff shows the decision to a reviewer).
- The snapshot is the same on every torch lane: annotations are strings, and a
  default's memory address is not part of a signature.
"""

from __future__ import annotations

import difflib
import inspect
import re
import sys
import types
from typing import Any

import pytest

import cadence
from tests._source_tree import ROOT

SNAPSHOT = ROOT / "tests" / "public_surface.txt"


def _signature(obj: Any) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def _class_lines(name: str, cls: type) -> list[str]:
    lines = [f"class {name}{_signature(cls)}"]
    for attr in sorted(dir(cls)):
        if attr.startswith("_"):
            continue
        owner = next((k for k in cls.__mro__ if attr in vars(k)), None)
        if owner is None or not owner.__module__.startswith("cadence"):
            continue
        raw = vars(owner)[attr]
        if isinstance(raw, property):
            lines.append(f"  property {name}.{attr}")
        elif isinstance(raw, (staticmethod, classmethod)):
            lines.append(f"  {type(raw).__name__} {name}.{attr}{_signature(raw.__func__)}")
        elif callable(raw):
            lines.append(f"  method {name}.{attr}{_signature(raw)}")
        else:
            lines.append(f"  attribute {name}.{attr}")
    return lines


def surface() -> list[str]:
    """The current surface, one entry per line."""
    lines: list[str] = []
    for name in sorted(cadence.__all__):
        obj = getattr(cadence, name)
        if isinstance(obj, types.ModuleType):
            lines.append(f"module {name}")
        elif inspect.isclass(obj):
            lines += _class_lines(name, obj)
        elif callable(obj):
            lines.append(f"function {name}{_signature(obj)}")
        else:
            lines.append(f"value {name}: {type(obj).__name__}")
    return lines


def test_the_public_surface_matches_its_snapshot() -> None:
    assert SNAPSHOT.is_file(), (
        f"{SNAPSHOT} is missing: run python -m tests.test_public_surface --write"
    )
    want = SNAPSHOT.read_text(encoding="utf-8").splitlines()
    got = surface()
    diff = "\n".join(difflib.unified_diff(want, got, "snapshot", "cadence now", lineterm=""))
    assert got == want, (
        "cadence's public surface changed. If that is intended, run "
        "'python -m tests.test_public_surface --write' and commit the file with the change:\n"
        + diff
    )


def test_the_snapshot_sees_a_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison is not vacuous: the surface is long, and a verb added to a public
    class shows up in it."""
    before = surface()
    assert len(before) > 50, len(before)
    assert any(line.startswith("  method DataParallel.finalize_backward(") for line in before)

    def extra_verb(self: Any, *, now: bool = False) -> None:
        """A stand-in for a method a change adds."""

    extra_verb.__module__ = cadence.DataParallel.__module__
    monkeypatch.setattr(cadence.DataParallel, "extra_verb", extra_verb, raising=False)
    added = set(surface()) - set(before)
    assert added == {
        "  method DataParallel.extra_verb(self: 'Any', *, now: 'bool' = False) -> 'None'"
    }, added


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python -m tests.test_public_surface --write")
    SNAPSHOT.write_text("\n".join(surface()) + "\n", encoding="utf-8")
    print(f"wrote {SNAPSHOT}")
