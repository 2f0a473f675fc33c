"""The docs name only what exists.

Specification: every ``cadence.<name>`` written in code spans (between backticks) in
``README.md`` and ``docs/*.md`` resolves: its longest importable module prefix
imports, and the rest are attributes of it. File names that merely start with
"cadence." (``cadence.json``, the checkpoint manifest) are not names. A renamed or
removed function then fails here, naming the page and the line, instead of leaving
a reader an ``AttributeError``.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import pytest

from tests._source_tree import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NAME = re.compile(r"`(cadence(?:\.[A-Za-z_]\w*)+)")
FILES = (".json", ".toml", ".py", ".md", ".png")


def _names() -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for name in NAME.findall(line):
                if not name.endswith(FILES):
                    out.append((page.relative_to(ROOT).as_posix(), number, name))
    return out


def _resolve(name: str) -> Any:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def test_the_pages_exist_and_name_cadence() -> None:
    assert len(PAGES) > 5 and all(p.is_file() for p in PAGES)
    assert len(_names()) > 50  # the scan finds names: a broken pattern cannot pass


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_cadence_name_on_the_page_resolves(page: str) -> None:
    broken = []
    for where, number, name in _names():
        if where != page:
            continue
        try:
            _resolve(name)
        except (ImportError, AttributeError) as e:
            broken.append(f"{where}:{number}: `{name}` ({type(e).__name__}: {e})")
    assert not broken, "names in the docs that do not exist:\n" + "\n".join(broken)
