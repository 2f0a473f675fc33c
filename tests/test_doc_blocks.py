"""Every fenced Python block in the README and ``docs/`` says whether it runs, and the
ones that say so run.

Specification:

- The line above each ````` ```python ````` fence (blank lines skipped) is a marker, an
  HTML comment GitHub does not render: ``<!-- doc-test: run -->`` for a complete
  script, or ``<!-- doc-test: fragment: REASON -->`` for a piece of a larger program
  (the reason names what is missing, or the example or test that runs it whole). A
  block without a marker fails, naming its file and line, so a new block is a
  decision, not an accident.
- Every block is valid Python (a fragment too: ``...`` stands for what is left out).
- Every ``run`` block runs as a script in a fresh interpreter (this lane's torch,
  the repository's ``cadence``), in an empty folder, and must exit 0 within
  `TIMEOUT_S`: a doc example that no longer works fails here with its output.
- Names the blocks use (``cadence.X``) are checked by tests/test_doc_names.py.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._source_tree import ROOT, SRC

TIMEOUT_S = 180
MARKER = re.compile(r"<!--\s*doc-test:\s*(run|fragment:\s*(?P<why>\S.*?))\s*-->")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # the fence's line, 1-based
    code: str
    marker: str | None  # "run", "fragment", or None (unmarked)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            above = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            m = MARKER.fullmatch(above.strip())
            marker = None if m is None else ("run" if m.group(1) == "run" else "fragment")
            found.append(Block(path, i + 1, "\n".join(lines[i + 1 : end]) + "\n", marker))
            i = end
        i += 1
    return found


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [b for path in DOCS for b in _blocks(path)]
RUNNABLE = [b for b in BLOCKS if b.marker == "run"]


def test_the_docs_have_python_blocks_to_check() -> None:
    # A parser that found nothing would make every test below pass vacuously.
    assert len(BLOCKS) >= 20 and len(RUNNABLE) >= 3, (len(BLOCKS), len(RUNNABLE))


def test_every_block_is_marked_run_or_fragment() -> None:
    unmarked = [b.where for b in BLOCKS if b.marker is None]
    assert not unmarked, (
        f"Python blocks without a doc-test marker: {unmarked}. Put "
        "'<!-- doc-test: run -->' (a complete script, run by this test) or "
        "'<!-- doc-test: fragment: REASON -->' on the line above the fence."
    )


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.where)
def test_every_block_is_python(block: Block) -> None:
    try:
        ast.parse(block.code, filename=block.where)
    except SyntaxError as exc:
        pytest.fail(f"{block.where}: not valid Python: {exc}")


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.where)
def test_every_runnable_block_runs(block: Block, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, (
        f"{block.where} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
