"""The one harness of the pickling tests: round trips in process, in a fresh interpreter,
and through a long-lived worker.

Every test that pickles takes the ``protocol`` fixture (``conftest.py``), so the whole
suite runs under protocols 4 and 5, as cloudpickle's own suite reruns per protocol.

Children import ``cadence.pickling`` without running ``cadence/__init__.py``: a stub
``cadence`` package whose ``__path__`` points at the source tree (``PRELUDE``). The
pickler needs only the standard library, so the stub changes nothing about what is
tested, and it keeps each child to a few tens of milliseconds. Tests that start children
batch their cases into one child per protocol.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import traceback
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cadence import pickling
from cadence.pickling import _tracker

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
TIMEOUT = 90
PROTOCOLS = (4, 5)

PRELUDE = f"""
import sys, types
_pkg = types.ModuleType("cadence")
_pkg.__path__ = [{str(SRC / "cadence")!r}]
sys.modules["cadence"] = _pkg
"""


# ---------------------------------------------------------------------------------------
# In process
# ---------------------------------------------------------------------------------------


def rt(obj: Any, protocol: int, **kwargs: Any) -> Any:
    """cadence.pickling.dumps, then the *standard* pickle.loads."""
    return pickle.loads(pickling.dumps(obj, protocol=protocol), **kwargs)


@contextlib.contextmanager
def fresh_tracker() -> Iterator[None]:
    """Load as a fresh process would: no tracked class is known, so classes are rebuilt.

    Without it, the tracker hands back the live class in the dumping process and a test
    of class pickling would prove nothing.
    """
    saved = _tracker._BY_ID, _tracker._COMPLETE
    _tracker._BY_ID, _tracker._COMPLETE = weakref.WeakValueDictionary(), weakref.WeakSet()
    try:
        yield
    finally:
        _tracker._BY_ID, _tracker._COMPLETE = saved


def rt_rebuilt(obj: Any, protocol: int) -> Any:
    """Round trip with the class tracker emptied for the load (see fresh_tracker)."""
    data = pickling.dumps(obj, protocol=protocol)
    with fresh_tracker():
        return pickle.loads(data)


# ---------------------------------------------------------------------------------------
# Fresh interpreters
# ---------------------------------------------------------------------------------------


def child_env(path: list[str] | None = None, env: dict[str, str] | None = None) -> dict[str, str]:
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    full["PYTHONPATH"] = os.pathsep.join([str(SRC), *(path or [])])
    full.update(env or {})
    return full


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
    script = (PRELUDE if light else "") + textwrap.dedent(code)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        env=child_env(path, env),
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


def run_script(script: Path, *args: str, cwd: Path, path: list[str] | None = None) -> Any:
    """Run ``script`` as ``__main__`` (as a user's driver script runs); return its JSON."""
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd,
        env=child_env([str(ROOT), *(path or [])]),
        capture_output=True,
        timeout=TIMEOUT,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{script.name} failed ({proc.returncode}):\n{proc.stderr.decode(errors='replace')}"
        )
    return json.loads(proc.stdout.decode().splitlines()[-1])


class Sections:
    """Named sections of a driver script: each records "ok" or its traceback.

    Used as ``with sections("name"):`` at module level, so what a section defines stays
    in ``__main__`` (a ``def`` per case would make every class ``<locals>``).
    """

    def __init__(self) -> None:
        self.results: dict[str, str] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.results[name] = traceback.format_exc()
        else:
            self.results[name] = "ok"

    def report(self) -> None:
        sys.stdout.write("\n" + json.dumps(self.results) + "\n")


# ---------------------------------------------------------------------------------------
# A long-lived worker, like a Dask or Ray worker
# ---------------------------------------------------------------------------------------

_WORKER = """
import pickle, struct, sys, traceback
from cadence import pickling
out, inp = sys.stdout.buffer, sys.stdin.buffer
sys.stdout = sys.stderr  # the pipe carries only framed payloads
protocol = int(sys.argv[1])
while True:
    head = inp.read(8)
    if len(head) < 8:
        break
    data = inp.read(struct.unpack(">Q", head)[0])
    try:
        func, args = pickle.loads(data)
        reply = ("ok", func(*args))
    except BaseException as exc:
        reply = ("err", f"{type(exc).__name__}: {exc}\\n{traceback.format_exc()}")
    data = pickling.dumps(reply, protocol=protocol)
    out.write(struct.pack(">Q", len(data)) + data)
    out.flush()
"""


class RemoteError(Exception):
    """A call in the worker raised; the message carries the remote traceback."""


class Worker:
    """One child process that runs the functions it is sent, as a Dask or Ray worker.

    Calls and results travel as cadence.pickling payloads in both directions, with the
    standard ``pickle.loads`` on each side. The worker is stateless between calls except
    for what the calls store (``sys.modules``, the class tracker), as a real one.
    """

    def __init__(self, protocol: int, path: list[str] | None = None) -> None:
        self.protocol = protocol
        self._proc = subprocess.Popen(
            [sys.executable, "-c", PRELUDE + _WORKER, str(protocol)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(path),
        )

    def run(self, func: Callable[..., Any], *args: Any) -> Any:
        data = pickling.dumps((func, args), protocol=self.protocol)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(struct.pack(">Q", len(data)) + data)
        self._proc.stdin.flush()
        head = self._proc.stdout.read(8)
        if len(head) < 8:
            raise RemoteError(f"worker died (exit code {self._proc.wait(TIMEOUT)})")
        kind, value = pickle.loads(self._proc.stdout.read(struct.unpack(">Q", head)[0]))
        if kind == "err":
            raise RemoteError(value)
        return value

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:  # pragma: no cover - a stuck worker
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
