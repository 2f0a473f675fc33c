"""The launcher: results, environment, whole output lines, and every failure mode
stops every rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import cadence
from cadence.testing import run_distributed
from tests.foundation import bodies_launch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def env3() -> list[dict[str, Any]]:
    return run_distributed(bodies_launch.env_and_threads, world_size=3)


def test_results_and_environment(env3: list[dict[str, Any]]) -> None:
    assert [r["rank"] for r in env3] == [0, 1, 2]
    for r in env3:
        assert r["world"] == 3 and r["env_rank"] == r["rank"] == r["local_rank"]
        assert r["threads"] == 1
        assert r["backend"] == "gloo"


STARTS = pytest.mark.parametrize("start", ["fresh", "warm"])  # see cadence/_warm.py


@STARTS
def test_a_raising_rank_stops_all_and_names_itself(start: str) -> None:
    with pytest.raises(cadence.LaunchError) as info:
        run_distributed(bodies_launch.raise_on_rank1, world_size=2, timeout=120, start=start)
    err = info.value
    assert isinstance(err, cadence.CadenceError)
    assert err.rank == 1
    assert "ValueError: boom from rank 1" in str(err)
    assert "raise_on_rank1" in err.remote_traceback  # the remote frame is shown
    # Rank 0 was blocked in a collective: it was stopped (or failed on the broken
    # connection), never left to run into the 120 s timeout.
    assert [o.rank for o in err.others] == [0]
    assert err.others[0].reason in ("stopped by the launcher", "raised")


@STARTS
def test_a_dying_rank_stops_all(start: str) -> None:
    with pytest.raises(cadence.LaunchError) as info:
        run_distributed(bodies_launch.exit_on_rank1, world_size=2, timeout=60, start=start)
    assert info.value.rank == 1
    assert info.value.failure.exit_code == 3
    assert "exited with code 3" in str(info.value)


@STARTS
def test_a_hanging_rank_times_out_and_no_process_is_left(tmp_path: Path, start: str) -> None:
    with pytest.raises(cadence.LaunchError) as info:
        run_distributed(
            bodies_launch.write_pid_then_hang,
            str(tmp_path / "pid"),
            world_size=2,
            timeout=8,
            start=start,
        )
    failures = [info.value.failure, *info.value.others]
    assert [f.reason for f in failures] == ["timeout", "timeout"]
    assert "did not finish within the timeout" in str(info.value)
    # The error names every rank's process, whether or not it got past start-up within
    # the timeout (a loaded machine can spend most of 8 s importing torch), so the check
    # below never depends on how far a rank got.
    pids = {f.rank: f.pid for f in failures}
    assert sorted(pids) == [0, 1] and all(pid is not None for pid in pids.values()), failures
    for rank, pid in pids.items():
        written = tmp_path / f"pid.{rank}"
        if written.exists():  # a rank that reached the body: the same process
            assert int(written.read_text()) == pid
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # type: ignore[arg-type]


@STARTS
def test_collective_hang_is_reported_with_the_hung_ranks(start: str) -> None:
    with pytest.raises(cadence.LaunchError) as info:
        run_distributed(bodies_launch.hang_forever, world_size=2, timeout=8, start=start)
    ranks = {info.value.rank, *(o.rank for o in info.value.others)}
    assert ranks == {0, 1}


def test_launch_accepts_bad_nprocs_early() -> None:
    with pytest.raises(ValueError, match="nprocs"):
        cadence.launch(bodies_launch.env_and_threads, nprocs=0)


def test_init_reuses_existing_group(env3: list[dict[str, Any]]) -> None:
    assert [r["init_world"] for r in env3] == [3, 3, 3]


def test_launch_ships_closures_and_lambdas() -> None:
    offset = 10

    def body(x: int) -> int:
        import torch.distributed as dist

        return (lambda y: y * offset + dist.get_rank())(x)

    # One launch: a lambda, closing over a local, that calls a closure.
    assert cadence.launch(lambda: (body(2), offset + 1), nprocs=2, timeout=60) == [
        (20, 11),
        (21, 11),
    ]


def test_launch_from_a_main_script(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import cadence\n"
        "scale = 4\n"
        "def work():\n"
        "    import torch.distributed as dist\n"
        "    return scale * (dist.get_rank() + 1)\n"
        "if __name__ == '__main__':\n"
        "    print(cadence.launch(work, nprocs=2, timeout=60))\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[4, 8]"


@STARTS
def test_ranks_printing_at_once_never_break_each_others_lines(
    capfd: pytest.CaptureFixture[str], start: str
) -> None:
    # print writes the text and its newline apart; unbuffered ranks would interleave them.
    run_distributed(bodies_launch.chatter, 300, world_size=2, start=start)
    out, err = capfd.readouterr()
    for stream, kind in ((out, "line"), (err, "err")):
        lines = [line for line in stream.splitlines() if line.startswith("rank ")]
        pad = "x" if kind == "line" else "y"
        expected = sorted(f"rank {r} {kind} {i} " + pad * 40 for r in (0, 1) for i in range(300))
        assert sorted(lines) == expected


@STARTS
@pytest.mark.parametrize("closed", [1, 2])
def test_a_launcher_whose_stdout_or_stderr_is_closed_still_launches(
    tmp_path: Path, start: str, closed: int
) -> None:
    # Left closed, the launch's first file or its warm server's socket would take the
    # descriptor's number and become every rank's output.
    result = tmp_path / "result"
    script = tmp_path / "main.py"
    script.write_text(
        "import os, sys\n"
        f"os.close({closed})\n"
        "import cadence\n"
        "from tests.foundation import bodies_launch\n"
        f"got = cadence.launch(bodies_launch.say_and_return, 'hi', nprocs=2, start={start!r})\n"
        f"open({str(result)!r}, 'w').write(repr(got))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert result.read_text() == "[0, 1]"
    # The descriptor left open still carries the ranks' lines.
    if closed == 1:
        assert "hi on stderr from rank 1" in done.stderr
    else:
        assert sorted(re.findall(r"hi from rank \d", done.stdout)) == [
            "hi from rank 0",
            "hi from rank 1",
        ]
