"""What checkpointing imports is declared in pyproject.toml.

Specification:
- every third-party top-level module that checkpointing imports
  (``cadence/train/checkpoint.py`` and the modules it is split into: ``_manifest``,
  ``_rng``, ``_dcp_read``), at module level or inside a function, is in
  ``[project] dependencies``: a plain ``pip install cadence`` must be able to save
  and load a checkpoint. numpy is among them (the RNG states), and torch's DCP needs
  it too ("Numpy is not available").
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "src" / "cadence" / "train"
CHECKPOINTING = [TRAIN / f"{m}.py" for m in ("checkpoint", "_manifest", "_rng", "_dcp_read")]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _third_party_imports(path: Path) -> set[str]:
    """Top-level modules imported anywhere in ``path`` (function bodies included),
    less the standard library and cadence itself."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__", "cadence"}


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # A requirement starts with its distribution name (PEP 508).
    return {_normalize(re.match(r"[A-Za-z0-9._-]+", r)[0]) for r in project["dependencies"]}


def test_checkpoint_imports_are_declared_dependencies() -> None:
    modules = set().union(*map(_third_party_imports, CHECKPOINTING))
    assert {"torch", "numpy"} <= modules
    # The distributions that install each module (numpy -> numpy), else its own name.
    dists = importlib.metadata.packages_distributions()
    declared = _declared()
    missing = sorted(
        m for m in modules if not {_normalize(d) for d in dists.get(m, [m])} & declared
    )
    assert not missing, f"imported by checkpointing, not in [project] dependencies: {missing}"
