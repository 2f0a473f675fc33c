"""Library code speaks through ``logging``; only a command's output modules print.

Specification: no module under ``src/cadence`` calls ``print`` except those whose
concern is a command's output (`PRINTING`, each with the command it serves): what a
run says on its way goes to a logger (``cadence.train``: see [Note: a run's messages
go through logging]), so a user's script can route or silence it. A printing module
that is listed but prints nothing any more fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast

import pytest

from tests._source_tree import modules

pytestmark = pytest.mark.torch_free

PRINTING = {
    "cadence.cli": "the `cadence` command's own messages",
    "cadence.train.report": "`cadence train`'s progress line, summary table and samples",
    "cadence.pipeline.schedule.show": "`cadence schedule show`'s grid and summary",
    "cadence.bench._calibrate": "`cadence bench --link calibrated`'s calibration lines",
    "cadence.bench._on_link": "`cadence bench --link`'s self-check line",
    "cadence.link._probe": "the link's self-check script, run as __main__ in the namespace",
    "cadence.link._delay_line": "the delay line, run as __main__ in the namespace: says ready",
}


def _prints(tree: ast.AST) -> list[int]:
    return sorted(
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"
    )


def test_only_a_commands_output_modules_print() -> None:
    found = {name: _prints(ast.parse(path.read_text())) for name, path in modules().items()}
    printing = {name: lines for name, lines in found.items() if lines}
    unlisted = {name: lines for name, lines in printing.items() if name not in PRINTING}
    assert not unlisted, (
        f"library modules print (lines): {unlisted}; log through a logger instead "
        "(logging.getLogger('cadence.<package>')), or list a command's output module "
        "in PRINTING with the command it serves"
    )
    stale = sorted(set(PRINTING) - set(printing))
    assert not stale, f"listed in PRINTING but print nothing: {stale}; remove them"
