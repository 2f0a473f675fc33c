"""A checkpointed ``cadence train`` needs nothing beyond what ``pip install cadence`` brings.

Specification:
- with every module hidden that neither the standard library, cadence, nor the
  closure of ``[project] dependencies`` (their own requirements included, extras
  excluded) provides, ``cadence train`` on two ranks saves checkpoints, and a second
  run resumes from them;
- the hiding is real: in that environment an undeclared module that is installed here
  (pytest) cannot be imported.

The environment is simulated, not installed: a folder of links to what a bare
install would hold replaces site-packages on ``sys.path`` (a ``sitecustomize`` does
it, in the CLI process and in every rank it spawns), so installing torch a second time
(gigabytes) is not needed to see what a bare install lacks. Modules outside it are
absent, not refused: ``importlib.util.find_spec`` answers None for them, as torch's
optional imports expect.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import site
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]

_SITECUSTOMIZE = """
import os, site, sys

_BARE = os.environ["CADENCE_TEST_BARE_SITE"]
_FULL = set(site.getsitepackages())
sys.path[:] = [p for p in sys.path if p not in _FULL] + [_BARE]
"""


def _dist_name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement)[0]).lower()


def _closure(requirements: list[str]) -> set[str]:
    """Distribution names reachable from ``requirements`` (extras not followed)."""
    seen: set[str] = set()
    todo = [r for r in requirements if "extra ==" not in r]
    while todo:
        name = _dist_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(r for r in md.requires(name) or [] if "extra ==" not in r)
        except md.PackageNotFoundError:
            continue  # a platform-only requirement not installed here
    return seen


def _bare_install() -> tuple[set[str], set[str]]:
    """The distributions ``pip install cadence`` brings, and the modules they hold."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    dists = _closure(declared)
    modules = {"cadence"}
    for module, owners in md.packages_distributions().items():
        if any(_dist_name(o) in dists for o in owners):
            modules.add(module)
    return dists, modules


def _bare_env(tmp_path: Path) -> dict[str, str]:
    """Environment variables for a process that sees only a bare install's modules."""
    dists, modules = _bare_install()
    bare = tmp_path / "bare-site"
    bare.mkdir()
    for full in map(Path, site.getsitepackages()):
        for entry in full.iterdir():
            # numpy/, numpy.libs/, numpy-2.1.0.dist-info/, typing_extensions.py, ...
            wanted = (
                entry.name.split(".")[0] in modules or _dist_name(entry.name.split("-")[0]) in dists
            )
            if wanted and not (bare / entry.name).exists():
                (bare / entry.name).symlink_to(entry)
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(custom), str(ROOT / "src")])
    env["CADENCE_TEST_BARE_SITE"] = str(bare)
    return env


def _cadence(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cadence.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_hiding_is_real(tmp_path: Path) -> None:
    env = _bare_env(tmp_path)
    code = "import importlib.util as u; print(u.find_spec('pytest'), u.find_spec('numpy') is None)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.stdout.split() == ["None", "False"], proc.stderr


def test_a_checkpointed_run_and_its_resume_need_only_declared_dependencies(
    tmp_path: Path,
) -> None:
    env = _bare_env(tmp_path)
    run = str(tmp_path / "run")
    small = ["--batch-size", "8", "--d-model", "16", "--layers", "2", "--nproc", "2"]
    first = _cadence(env, "train", *small, "--steps", "4", "--checkpoint-every", "2",
                     "--run-dir", run)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step-2",
        "step-4",
    ]
    again = _cadence(env, "train", *small, "--steps", "6", "--checkpoint-every", "2",
                     "--run-dir", run, "--resume")  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step-4 (step 4)" in again.stderr
