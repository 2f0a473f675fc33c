"""The FSDP2 reading stays answered: every NO or PARTIAL row has a test or a reason.

Specification:

- ``docs/fsdp2-cpu-tests.md`` is the reading of record of torch's FSDP2 tests: each
  row has a number, and a verdict (NO or PARTIAL where cadence had no full test).
- ``docs/torch-suite.md``'s table "Every NO or PARTIAL row of the reading" lists row
  numbers (``14``, ``19, 43, 45``, ranges with an en dash) with where each stands now. Every
  NO or PARTIAL row must be in it, so that a row cannot be left unanswered.
- Every backticked name in that table that looks like a scenario (a bare identifier,
  optionally with a ``-case`` suffix) must be a scenario of one of the FSDP2 parity
  bodies, and every ``tests/...`` path must exist, so that the table cannot name a
  test that was renamed or removed.
"""

from __future__ import annotations

import importlib
import re

from tests._source_tree import ROOT

READING = ROOT / "docs" / "fsdp2-cpu-tests.md"
SUITE = ROOT / "docs" / "torch-suite.md"
HEADING = "### Every NO or PARTIAL row of the reading"
DASH = "\u2013"  # the docs write row ranges as 72<en dash>74
ROW = rf"\| ([0-9][0-9{DASH}, ]*) "  # a table row's first cell: row numbers
BODIES = ("bodies_torch_checks", "bodies_torch_runtime", "bodies_torch_usage")


def _numbers(cell: str) -> set[int]:
    """``"14"``, ``"19, 43"``, a range ``"72<en dash>74"`` -> the row numbers."""
    out: set[int] = set()
    for part in cell.split(","):
        lo, _, hi = part.strip().partition(DASH)
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _open_rows() -> set[int]:
    rows: set[int] = set()
    for line in READING.read_text(encoding="utf-8").splitlines():
        m = re.match(ROW + r"\|", line)
        if m and ("**NO**" in line or "**PARTIAL**" in line):
            rows |= _numbers(m.group(1))
    return rows


def _answer_table() -> dict[int, str]:
    text = SUITE.read_text(encoding="utf-8")
    assert HEADING in text, f"{SUITE.name} lacks the section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n#", 1)[0]
    table: dict[int, str] = {}
    for line in section.splitlines():
        m = re.match(ROW + r"\| (.+) \|$", line)
        if m:
            for n in _numbers(m.group(1)):
                table[n] = m.group(2)
    return table


def _scenario_names() -> set[str]:
    names: set[str] = set()
    for module in BODIES:
        mod = importlib.import_module(f"tests.fsdp.{module}")
        for attr in ("SCENARIOS", "SCENARIOS_WS1"):
            names |= {s.name for s in getattr(mod, attr, [])}
    return names


def test_every_open_row_of_the_reading_is_answered() -> None:
    open_rows = _open_rows()
    assert len(open_rows) > 30, f"found only {sorted(open_rows)} NO/PARTIAL rows: parse broke?"
    missing = sorted(open_rows - set(_answer_table()))
    assert not missing, f"rows {missing} of {READING.name} have no answer under {HEADING!r}"


def test_every_scenario_and_file_the_answers_name_exists() -> None:
    known = _scenario_names()
    named: set[str] = set()
    paths: set[str] = set()
    for answer in _answer_table().values():
        for ref in re.findall(r"`([^`]+)`", answer):
            if ref.startswith("tests/"):
                paths.add(ref)
            elif re.fullmatch(r"[a-z_0-9]+(-[A-Za-z_0-9]+)?", ref) and "_" in ref:
                named.add(ref)
    assert len(named) > 20, f"found only {sorted(named)}: parse broke?"
    unknown = sorted(named - known)
    assert not unknown, f"{SUITE.name} names scenarios that do not exist: {unknown}"
    absent = sorted(p for p in paths if not (ROOT / p).exists())
    assert not absent, f"{SUITE.name} names files that do not exist: {absent}"
