"""Fresh-interpreter helpers for the pickling tests.

Children import ``cadence.pickling`` without running ``cadence/__init__.py`` (which pulls
in torch and costs seconds on a busy machine): a stub ``cadence`` package whose
``__path__`` points at the source tree. The pickler needs only the stdlib, so the stub
changes nothing about what is tested, and a dozen children stay well within the budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
TIMEOUT = 60

PRELUDE = f"""
import sys, types
_pkg = types.ModuleType("cadence")
_pkg.__path__ = [{str(SRC / "cadence")!r}]
sys.modules["cadence"] = _pkg
"""


def run_python(
    code: str,
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
    path: list[str] | None = None,
    light: bool = True,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``code`` in a fresh interpreter whose sys.path holds only ``path`` extras."""
    full_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    full_env["PYTHONPATH"] = os.pathsep.join([str(SRC), *(path or [])])
    full_env.update(env or {})
    script = (PRELUDE if light else "") + textwrap.dedent(code)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        env=full_env,
        input=stdin,
        capture_output=True,
        timeout=TIMEOUT,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"child failed ({proc.returncode}):\n{proc.stderr.decode(errors='replace')}"
        )
    return proc


def load_in_child(
    payload: bytes, check: str, *, cwd: Path, path: list[str] | None = None, pre: str = ""
) -> Any:
    """Load ``payload`` with plain ``pickle.loads`` in a child, run ``check`` on ``obj``.

    ``check`` assigns ``result`` (JSON-serialisable), which comes back to the caller.
    """
    code = (
        "import json, pickle\n"
        + textwrap.dedent(pre)
        + "\nobj = pickle.loads(sys.stdin.buffer.read())\n"
        + textwrap.dedent(check)
        + "\nsys.stdout.write(json.dumps(result))\n"
    )
    proc = run_python(code, cwd=cwd, stdin=payload, path=path)
    return json.loads(proc.stdout.decode())
