"""Warm ranks for `cadence.launch`: the launcher's side of a fork server that has
imported torch once (the server is ``cadence/_fork_server.py``).

[Note: warm ranks]
A fresh rank spends most of its start importing torch (about 2 s of CPU for a CUDA
build), and a test suite launches ranks hundreds of times. ``launch(start="warm")``
asks a fork server instead: one interpreter per launching process, started on first
use (``python -m cadence._fork_server``), that imports torch, torch.distributed and
cadence and then only forks. Each child is what ``python -m cadence._worker`` would
be: its own session (so stopping it stops what it started), the launch's
environment, working folder and stdout/stderr (the launcher's descriptors 1 and 2 at
that moment, sent over the socket, as a fresh rank inherits them), then the worker's
command line, run as ``python -m`` would. What it inherits beyond a fresh rank is the
imported modules and nothing else: the server never initializes CUDA, a process
group or torch's thread pools, and stays single-threaded, so a fork of it is safe.
Environment read at import time (``OMP_NUM_THREADS`` by the OpenMP runtime) is the
server's, taken from the launcher's environment when the server started.

The server speaks only to the process that started it, over an inherited socket
pair (JSON lines, no pickle): each request names a work folder and a rank, and the
server answers with the child's pid and later its exit status (as ``Popen`` reports
it: negative for a signal). It exits when its socket closes, stopping any child
still running. `WarmRank` gives the launcher the part of ``Popen`` it uses.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from cadence.errors import CadenceRuntimeError

__all__ = ["WarmRank"]

_START_TIMEOUT_S = 60.0


class _Server:
    """The launcher's side of one fork server."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cadence._fork_server", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self.sock = mine
        self.buffer = b""
        self.exits: dict[int, int] = {}
        self.closed = False
        self._expect("ready", _START_TIMEOUT_S)

    def _read(self, timeout: float) -> list[dict[str, Any]]:
        """Messages that arrive within ``timeout`` seconds (0: those already here)."""
        self.sock.settimeout(timeout if timeout > 0 else 0.0)
        try:
            chunk = self.sock.recv(65536)
        except (BlockingIOError, TimeoutError):
            chunk = None
        except OSError:
            chunk = b""
        if chunk == b"":
            self.closed = True
        elif chunk:
            self.buffer += chunk
        lines = self.buffer.split(b"\n")
        self.buffer = lines.pop()
        messages = [json.loads(line) for line in lines if line]
        for m in messages:
            if "exit" in m:
                self.exits[int(m["exit"])] = int(m["code"])
        return messages

    def _expect(self, key: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.closed and time.monotonic() < deadline:
            for m in self._read(max(0.0, deadline - time.monotonic())):
                if key in m:
                    return m
        raise CadenceRuntimeError(
            f"cadence's warm-rank server (cadence._fork_server) did not answer ({key!r}); "
            'launch with start="fresh" to start each rank in its own interpreter'
        )

    def fork(self, work: Path, rank: int, env: dict[str, str]) -> int:
        request = {"work": str(work), "rank": rank, "env": env, "cwd": os.getcwd()}
        data = (json.dumps(request) + "\n").encode()
        # Descriptors 1 and 2, not sys.stdout's: a replaced sys.stdout (pytest's capsys,
        # a notebook) has no descriptor, and a fresh rank inherits these two.
        socket.send_fds(self.sock, [data], [1, 2])
        return int(self._expect("pid", _START_TIMEOUT_S)["pid"])

    def poll(self) -> None:
        self._read(0)


_lock = threading.Lock()
_server: _Server | None = None


def _the_server() -> _Server:
    global _server
    if _server is None or _server.closed or _server.proc.poll() is not None:
        _server = _Server()
    return _server


class WarmRank:
    """Rank ``rank`` of the launch whose folder is ``work``, forked with ``env``: as
    much of ``subprocess.Popen`` as the launcher uses."""

    def __init__(self, work: Path, rank: int, env: dict[str, str]) -> None:
        with _lock:
            self._server = _the_server()
            self.pid = self._server.fork(work, rank, env)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with _lock:
                self._server.poll()
                code = self._server.exits.pop(self.pid, None)
                if code is None and self._server.closed:
                    # The server died; its status of this rank is lost. Reported as
                    # killed, the rank fails the launch, whose stop signals every
                    # rank's session, an orphan still running included.
                    code = -signal.SIGKILL
            self.returncode = code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"warm rank {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code
