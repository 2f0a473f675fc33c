"""A torchrun rank of ``cadence train`` leaves the process group it made before it exits.

Specification (see [Note: a torchrun rank leaves its process group before it exits]):
- after ``cadence train`` returns in a process with torchrun's variables, the default
  process group it created is destroyed, so the interpreter's shutdown tears nothing
  of it down;
- a group the caller created before calling ``train`` is left to the caller.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_lane  # [Note: one lane runs each end-to-end run of cadence train]

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import sys
import torch.distributed as dist
from cadence.cli import main
if sys.argv[1] == "caller":
    dist.init_process_group("gloo", rank=0, world_size=1)
code = main(["train", "--batch-size", "8", "--d-model", "16", "--layers", "2",
             "--steps", "2", "--run-dir", sys.argv[2]])
print("exit", code, "initialized", dist.is_initialized())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("who", "left"), [("train", False), ("caller", True)])
def test_the_group_is_destroyed_by_whoever_made_it(tmp_path: Path, who: str, left: bool) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(_free_port()))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, who, str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exit 0 initialized {left}" in proc.stdout
