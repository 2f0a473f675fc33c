"""Where cadence's errors live, and what they derive from.

Specification (the source is parsed, never run; no torch):

- Every exception or warning class under ``src/cadence`` is defined in an errors
  module: ``errors.py`` for the top-level modules, one ``_errors.py`` per package
  (``pipeline/runtime/errors.py``, whose path users import, keeps its name). A
  maintainer finds every error of an area in one file. `EXEMPT_HOME` lists the
  exceptions to this, each with its reason.
- Every exception class derives from `cadence.errors.CadenceError`, so a caller can
  catch everything cadence refused in one clause, except the internal signals in
  `NOT_CADENCE_ERRORS`, each with its reason.
- Every errors module holds only errors (and warnings): no function, no other class.
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

from tests._source_tree import ROOT

pytestmark = pytest.mark.torch_free

SRC = ROOT / "src" / "cadence"

# (module path under src/cadence, class) -> why it lives outside an errors module.
EXEMPT_HOME: dict[tuple[str, str], str] = {
    ("launch.py", "LaunchError"): (
        "its message is built from launch's RankFailure records, and errors.py imports "
        "nothing from cadence (every module imports it)"
    ),
}
# (module path, class) -> why it is not a CadenceError.
NOT_CADENCE_ERRORS: dict[tuple[str, str], str] = {
    ("precompiling/_errors.py", "ArtifactRefused"): (
        "a signal inside precompile that the loaders always catch; an `except "
        "CadenceError` inside cadence must not swallow it"
    ),
}


def _is_errors_module(rel: str) -> bool:
    return Path(rel).name in ("errors.py", "_errors.py")


def _classes() -> dict[str, tuple[str, list[str]]]:
    """Every top-level class: name -> (module path, base names)."""
    found: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
                assert node.name not in found or not _is_errors_module(rel), (
                    f"two classes named {node.name}: {found[node.name][0]} and {rel}"
                )
                found.setdefault(node.name, (rel, bases))
    return found


CLASSES = _classes()


def _ancestors(name: str) -> set[str]:
    """Every base name reachable from ``name`` through cadence's classes."""
    seen: set[str] = set()
    todo = list(CLASSES[name][1]) if name in CLASSES else []
    while todo:
        base = todo.pop()
        if base in seen:
            continue
        seen.add(base)
        if base in CLASSES:
            todo += CLASSES[base][1]
    return seen


def _builtin_exception(name: str) -> type | None:
    value = getattr(builtins, name, None)
    return value if isinstance(value, type) and issubclass(value, BaseException) else None


def _kind(name: str) -> str | None:
    """ "error", "warning" or None (not an exception class)."""
    builtin = [b for b in (_builtin_exception(a) for a in _ancestors(name)) if b is not None]
    if not builtin:
        return None
    return "warning" if any(issubclass(b, Warning) for b in builtin) else "error"


ERRORS = {n: CLASSES[n][0] for n in CLASSES if _kind(n) is not None}


def test_the_tree_has_errors_to_check() -> None:
    # A parser that found nothing would pass every rule below.
    assert {"CadenceError", "FullyShardError", "ScheduleValidationError"} <= set(ERRORS)


def test_every_error_lives_in_an_errors_module() -> None:
    stray = [
        f"{rel}: {name}"
        for name, rel in sorted(ERRORS.items())
        if not _is_errors_module(rel) and (rel, name) not in EXEMPT_HOME
    ]
    assert not stray, (
        "define these in the package's _errors.py (errors.py for a top-level module) and "
        "import them where they are raised: " + ", ".join(stray)
    )


def test_every_error_is_a_cadence_error() -> None:
    outside = [
        f"{rel}: {name}"
        for name, rel in sorted(ERRORS.items())
        if _kind(name) == "error"
        and name != "CadenceError"
        and "CadenceError" not in _ancestors(name)
        and (rel, name) not in NOT_CADENCE_ERRORS
    ]
    assert not outside, (
        "derive these from cadence.errors.CadenceError (or one of its children) as well as "
        "their builtin base: " + ", ".join(outside)
    )


def test_errors_modules_hold_only_errors() -> None:
    others = [
        f"{rel}: {name}"
        for name, (rel, _) in sorted(CLASSES.items())
        if _is_errors_module(rel) and _kind(name) is None
    ]
    functions = [
        f"{path.relative_to(SRC).as_posix()}: {node.name}"
        for path in sorted(SRC.rglob("*.py"))
        if _is_errors_module(path.relative_to(SRC).as_posix())
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    assert not others and not functions, others + functions


def test_the_exemptions_are_still_needed() -> None:
    # An exemption whose class moved or was fixed would hide the next stray one.
    for rel, name in EXEMPT_HOME:
        assert ERRORS.get(name) == rel and not _is_errors_module(rel)
    for rel, name in NOT_CADENCE_ERRORS:
        assert ERRORS.get(name) == rel and "CadenceError" not in _ancestors(name)
