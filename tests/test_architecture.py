"""Architecture rules, checked on the source tree (no process group, no torch needed).

- No import cycles between cadence's modules. Every import counts, including those
  inside functions and under ``TYPE_CHECKING``: a type two modules share belongs in a
  third module that both import. (Which module may import which is the allowed-imports
  table of tests/test_allowed_imports.py.)
- No line cap: modules are split along their concerns (the one-line concern each has
  in docs/architecture.md), never to meet a line count.
- No comment or docstring points outside the repository ("issue 5", "design note §3"):
  the reasoning is written next to the code as a ``[Note: ...]`` block instead.
- docs/architecture.md names every module under ``src/cadence`` (by its path there,
  ``pipeline/runtime/groups.py``, or its dotted name), and every ``.py`` path it names
  exists: the map cannot silently drift from the code, either way.
- The test folders mirror ``src/cadence``: ``tests/<package>/`` tests
  ``src/cadence/<package>/`` (``tests/pipeline/runtime/`` tests
  ``pipeline/runtime/``). The two folders that mirror no package are listed in
  `TEST_FOLDERS_BEYOND_PACKAGES` with what they hold.
- Every ``See [Note: ...]`` names a Note that is written once, in ``src/cadence``: a
  Note renamed or moved away cannot leave its readers pointing at nothing.

The ``KNOWN_*`` sets list what is still being moved; each entry is removed when it is
fixed, and a fixed entry that is still listed fails the test, so the lists only shrink.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._source_tree import PACKAGE, ROOT, SRC, cadence_imports, module_path, modules

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free

ARCHITECTURE = ROOT / "docs" / "architecture.md"

KNOWN_CYCLES: set[frozenset[str]] = set()
TEST_FOLDERS_BEYOND_PACKAGES = {
    "foundation": "the top-level modules of src/cadence (comm, topology, launch, timing, ...)",
    "scale": "every wrapper at simulated worlds of 64 to 8192 ranks (torch's fake group)",
}
KNOWN_OUTSIDE_REFS: set[str] = set()

_OUTSIDE_REF = re.compile(
    r"\bissues?\s*#?\d+\b|design (note|table)|shared/design|§|the note's"
    r"|\bthe issue\b(?!\s+orders?)",
    re.IGNORECASE,
)


def _cycles() -> set[frozenset[str]]:
    graph = {m: set(cadence_imports(m)) for m in modules()}
    # Tarjan's strongly connected components; a component of two or more is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: set[frozenset[str]] = set()
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.add(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _py_files() -> list[Path]:
    return [
        p
        for d in ("src", "tests", "examples")
        for p in sorted((ROOT / d).rglob("*.py"))
        if ".venv" not in p.parts
    ]


def _text_files() -> list[Path]:
    """Files a reader follows: code, and the docs beside it."""
    docs = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
    return [p for p in _py_files() if p.name != Path(__file__).name] + docs


def test_no_import_cycles() -> None:
    cycles = _cycles()
    new = cycles - KNOWN_CYCLES
    assert not new, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in new)
    fixed = KNOWN_CYCLES - cycles
    assert not fixed, f"remove fixed entries from KNOWN_CYCLES: {fixed}"


def test_no_reference_outside_the_repository() -> None:
    refs = set()
    for p in _text_files():
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if _OUTSIDE_REF.search(line):
                refs.add(f"{p.relative_to(ROOT)}:{i}")
    files = {r.rpartition(":")[0] for r in refs}
    new = files - KNOWN_OUTSIDE_REFS
    assert not new, "write the reasoning in place of: " + ", ".join(
        sorted(r for r in refs if r.rpartition(":")[0] in new)
    )
    fixed = KNOWN_OUTSIDE_REFS - files
    assert not fixed, f"remove fixed entries from KNOWN_OUTSIDE_REFS: {fixed}"


def _named(text: str, name: str) -> bool:
    """Whether ``text`` names module ``name`` by its path under src/cadence or dotted."""
    path = re.escape(module_path(name))
    if re.search(rf"(?<![\w/.]){path}(?![\w/])", text):
        return True
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w]|\.\w)", text) is not None


def test_the_architecture_doc_names_every_module() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    missing = [module_path(m) for m in modules() if not _named(text, m)]
    assert not missing, (
        "docs/architecture.md does not name these modules; add each, with its one-line "
        "concern, to the module tables: " + ", ".join(missing)
    )


def test_every_path_the_architecture_doc_names_exists() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    paths = set(re.findall(r"`([\w./-]+\.py)`", text))
    gone = sorted(p for p in paths if not any((d / p).exists() for d in (PACKAGE, SRC, ROOT)))
    assert not gone, f"docs/architecture.md names files that do not exist: {gone}"


# A Note is written where a line starts with its title (in a docstring, or after "# "),
# followed by the end of the line or its first sentence; anywhere else it is a reference.
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")
_NOTE_WRITTEN = re.compile(r"^(?:# )?\[Note: ([^\]]+)\](?:$| [A-Z(`\"])")


def _notes() -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    written: dict[str, list[str]] = {}
    cited: list[tuple[str, str]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{path.relative_to(SRC)}:{number}"
            stripped = line.strip()
            title = _NOTE_WRITTEN.match(stripped)
            if title:
                written.setdefault(title.group(1), []).append(where)
                stripped = stripped[title.end(1) + 1 :]
            cited += [(m.group(1), where) for m in _NOTE.finditer(stripped)]
    return written, cited


def test_every_cited_note_is_written_once() -> None:
    written, cited = _notes()
    twice = {title: places for title, places in written.items() if len(places) > 1}
    assert not twice, f"Notes written more than once (keep one, cite it elsewhere): {twice}"
    dangling = sorted(
        {f"[Note: {title}] at {where}" for title, where in cited if title not in written}
    )
    assert not dangling, "cited but never written (rename the citation or write the Note): " + (
        ", ".join(dangling)
    )


def test_test_folders_mirror_the_packages() -> None:
    tests = ROOT / "tests"
    folders = {
        p.parent.relative_to(tests).as_posix()
        for p in tests.rglob("test_*.py")
        if p.parent != tests
    }
    stray = sorted(
        f for f in folders if not (PACKAGE / f).is_dir() and f not in TEST_FOLDERS_BEYOND_PACKAGES
    )
    assert not stray, (
        f"test folders that mirror no package under src/cadence: {stray}; name the folder "
        "after the package it tests"
    )
    unused = sorted(f for f in TEST_FOLDERS_BEYOND_PACKAGES if f not in folders)
    assert not unused, f"remove these from TEST_FOLDERS_BEYOND_PACKAGES: {unused}"
