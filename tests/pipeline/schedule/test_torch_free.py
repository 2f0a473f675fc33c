"""The schedule layer and ``cadence schedule show`` work where torch is not installed.

Each check runs in a fresh interpreter whose ``import torch`` raises, as on a
machine without torch (a laptop planning a schedule, a CI lint job).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free

ROOT = Path(__file__).resolve().parents[3]

# Installed first in the child: any import of torch (or a torch submodule) fails.
_BLOCK_TORCH = """
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is not installed (blocked by the test): {name}")
        return None

sys.meta_path.insert(0, _NoTorch())
for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
    del sys.modules[name]
"""


def _run(body: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "child.py"
    script.write_text(_BLOCK_TORCH + textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )


def test_blocker_really_blocks(tmp_path: Path) -> None:
    r = _run("import torch\n", tmp_path)
    assert r.returncode != 0 and "blocked by the test" in r.stderr


def test_schedule_layer_without_torch(tmp_path: Path) -> None:
    r = _run(
        """
        import cadence, cadence.pipeline, cadence.pipeline.schedule as S
        from cadence.pipeline import Schedule, generate, lower, verify
        low = lower(generate("interleaved", 4, 8, 2))
        assert verify(low).makespan == 28.5
        assert len(S.channel_plan(low).edges) == 8
        assert Schedule.from_json(low.to_json()) == low
        from cadence.train.config import TrainConfig
        TrainConfig(pp=2, schedule="zbv")
        assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
        print("ok")
        """,
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_cadence_schedule_show_without_torch(tmp_path: Path) -> None:
    try:
        import matplotlib  # noqa: F401  (the PNG needs it; it must not need torch)

        out = ["--out", str(tmp_path / "s.png")]
    except ImportError:
        out = []
    r = _run(
        f"""
        import runpy
        sys.argv = ["cadence", "schedule", "show", "zbv", "--pp", "4", "-m", "8", *{out!r}]
        try:
            runpy.run_module("cadence", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            assert e.code == 0, e.code
        assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
        """,
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "makespan 25.5" in r.stdout and "channels (6)" in r.stdout
    if out:
        assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_without_torch_says_what_it_needs(tmp_path: Path) -> None:
    r = _run(
        """
        from cadence.cli import main
        print("rc", main(["schedule", "compare", "zbv", "--pp", "2", "-m", "4"]))
        """,
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "rc 1" in r.stdout
    assert "needs torch's pipelining generators" in r.stderr and "cadence schedule show" in r.stderr


def test_train_needs_torch_only_when_it_runs(tmp_path: Path) -> None:
    r = _run(
        """
        from cadence.cli import main
        try:
            main(["train", "--steps", "1"])
        except ImportError as e:
            print("needs torch:", e)
        """,
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "needs torch" in r.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["train", "--help"],
        ["schedule", "show", "--help"],
        ["schedule", "compare", "--help"],
    ],
)
def test_help_without_torch(tmp_path: Path, argv: list[str]) -> None:
    r = _run(
        f"""
        from cadence.cli import main
        try:
            main({argv!r})
        except SystemExit as e:
            assert e.code == 0
        """,
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "usage: cadence" in r.stdout
