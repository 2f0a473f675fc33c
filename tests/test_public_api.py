"""The lazy public API of `cadence`, and its one version string.

Specification:

- Every name in ``cadence.__all__`` resolves, without a warning, and is listed by
  ``dir(cadence)``; a resolved name is cached in the package, so the second lookup
  is the same object. (``import cadence`` loading no torch is checked with torch
  blocked, in tests/pipeline/schedule/test_torch_free.py.)
- An unknown name is an `AttributeError` naming it: nothing is served under an
  old spelling.
- The version is written once, in ``cadence/_util/version.py``, served as
  ``cadence.__version__``; ``pyproject.toml`` declares it dynamic and reads it there.
"""

from __future__ import annotations

import re
import warnings

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

import cadence
from tests._source_tree import ROOT


def test_every_public_name_resolves_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in cadence.__all__:
            first = getattr(cadence, name)
            assert getattr(cadence, name) is first, name
    assert set(cadence.__all__) <= set(dir(cadence))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'cadence' has no attribute 'Pipeline'"):
        cadence.Pipeline


def test_the_version_is_written_once() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "cadence._util.version.__version__"
    }
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", cadence.__version__)


def test_the_package_says_it_is_typed() -> None:
    """PEP 561: ``py.typed`` beside the package, and declared as package data so that a
    built wheel carries it too (a type checker then reads cadence's own annotations)."""
    import importlib.resources

    assert importlib.resources.files("cadence").joinpath("py.typed").is_file()
    with (ROOT / "pyproject.toml").open("rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert data == {"cadence": ["py.typed"]}
