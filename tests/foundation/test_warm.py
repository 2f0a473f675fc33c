"""Warm ranks ([Note: warm ranks] in cadence/_warm.py): forked from one server that
imported torch once, and otherwise what a fresh rank is.

Specification:
- a warm rank runs in its own session, with the launch's environment (``env`` and
  variables the launcher set after the server started) and working folder, and
  writes to the launcher's descriptors 1 and 2 as they are when it starts (whatever
  ``sys.stdout`` is);
- every launch of one process asks the same server, and a server that died is
  replaced by the next launch;
- ``start`` is "fresh" or "warm", refused otherwise before any rank starts.
The failure modes (a raising, dying or hanging rank) are in test_launch.py, for
both starts.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import cadence
from cadence.testing import run_distributed
from tests.foundation import bodies_launch


def test_a_warm_rank_has_the_launch_environment_folder_and_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_distributed(bodies_launch.env_and_threads, world_size=1)  # the server is up
    monkeypatch.setenv("CADENCE_TEST_LATE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    got = cadence.launch(
        bodies_launch.identity, nprocs=2, env={"CADENCE_TEST_EXTRA": "x"}, start="warm"
    )
    for rank, r in enumerate(got):
        assert r["env"]["CADENCE_TEST_LATE"] == "set after the server started"
        assert r["env"]["CADENCE_TEST_EXTRA"] == "x" and r["env"]["RANK"] == str(rank)
        assert r["cwd"] == str(tmp_path)
        assert r["sid"] == r["pid"]  # a session of its own, as a fresh rank's
    assert got[0]["parent"] == got[1]["parent"]  # both forked by the one server


def test_a_warm_rank_prints_to_the_launchers_stdout_and_stderr(
    capfd: pytest.CaptureFixture[str],
) -> None:
    run_distributed(bodies_launch.say, "hello", world_size=2)
    out, err = capfd.readouterr()
    assert sorted(line for line in out.splitlines() if "hello" in line) == [
        "hello from rank 0",
        "hello from rank 1",
    ]
    assert "hello on stderr from rank 1" in err


def test_a_launcher_whose_sys_stdout_is_replaced_still_launches(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # capsys swaps sys.stdout for an object with no descriptor; a rank gets fd 1 and 2.
    assert run_distributed(bodies_launch.identity, world_size=1)[0]["env"]["RANK"] == "0"


def test_every_launch_asks_one_server_and_a_dead_one_is_replaced() -> None:
    first = run_distributed(bodies_launch.identity, world_size=1)[0]["parent"]
    assert run_distributed(bodies_launch.identity, world_size=1)[0]["parent"] == first
    os.kill(first, signal.SIGKILL)
    os.waitpid(first, 0)  # the server is this process's child
    again = run_distributed(bodies_launch.identity, world_size=1)[0]["parent"]
    assert again != first


def test_start_is_fresh_or_warm() -> None:
    with pytest.raises(ValueError, match='start must be "fresh" or "warm"'):
        cadence.launch(bodies_launch.identity, nprocs=1, start="hot")


def test_the_server_has_torch_loaded_before_it_forks() -> None:
    # What makes a warm rank cheap: the process it is forked from has torch loaded.
    parent = run_distributed(bodies_launch.identity, world_size=1)[0]["parent"]
    maps = Path(f"/proc/{parent}/maps")
    if not maps.exists():
        pytest.skip("no /proc on this system")
    assert "libtorch" in maps.read_text()
