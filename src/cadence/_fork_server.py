"""The fork server of warm ranks: ``python -m cadence._fork_server FD``.

See [Note: warm ranks] in ``cadence/_warm.py``, the launcher's side. This process
imports torch and cadence once, then forks one rank per request read from the socket
``FD`` (inherited from the launcher), runs the worker's command line in the child and
reports each child's pid and exit status. It stays single-threaded and never runs a
torch operation, so every fork starts from imported modules and nothing else.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
from typing import Any

# What every rank would import first; a command line, so imported by name.
PRELOAD = ("torch", "torch.distributed", "cadence", "cadence.launch", "cadence.pickling")


def _child(sock: socket.socket, own: list[int], request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the rank, run it, exit. Never returns."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in own:  # the server's wake-up pipe and selector
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds):
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        # Exactly ``python -m cadence._worker DIR RANK``, which exits by itself.
        sys.argv = ["cadence._worker", request["work"], str(request["rank"])]
        runpy.run_module("cadence._worker", run_name="__main__", alter_sys=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        sock.sendall((json.dumps({"exit": pid, "code": code}) + "\n").encode())


def serve(fd: int) -> None:
    """The server's loop: fork a rank per request until the socket closes."""
    for name in PRELOAD:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
    children: set[int] = set()
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(read_end, selectors.EVENT_READ)
    sock.sendall(b'{"ready": true}\n')
    buffer = b""
    fds: list[int] = []
    try:
        while True:
            for key, _ in sel.select():
                if key.fileobj == read_end:
                    os.read(read_end, 4096)
                    _reap(sock, children)
                    continue
                data, got, _flags, _addr = socket.recv_fds(sock, 65536, 8)
                if not data:
                    return
                fds += got
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    request, mine = json.loads(line), fds[:2]
                    del fds[:2]
                    pid = os.fork()
                    if pid == 0:
                        _child(sock, [read_end, write_end, sel.fileno()], request, mine)
                    for f in mine:
                        os.close(f)
                    children.add(pid)
                    sock.sendall((json.dumps({"pid": pid}) + "\n").encode())
            _reap(sock, children)
    finally:
        for pid in children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


if __name__ == "__main__":
    serve(int(sys.argv[1]))
