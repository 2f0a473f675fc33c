"""A local multi-process launcher: ``cadence.launch(fn, *args, nprocs=N)``.

Each rank is a fresh interpreter (``python -m cadence._worker``), not a fork of the
caller, so CUDA and gloo state never leak between ranks and ``__main__`` closures
work: the function travels by value through `cadence.pickling`. With
``start="warm"`` (what `cadence.testing.run_distributed` uses) a rank is forked
from a server that has only imported torch and cadence, never initialized CUDA or
a group, so the same holds (see [Note: warm ranks] in ``cadence/_warm.py``).

Every rank of one launch gets the same fresh ``CADENCE_JOB_SECRET`` in its
environment (see [Note: the job secret]) unless ``env`` sets one. The work folder the
ranks read their function and arguments from (and unpickle) is a private temporary
folder (mode 0700): nobody else can swap what a rank runs.

Failure policy: the first rank that raises, dies or outlives the timeout stops
every rank (SIGTERM, then SIGKILL after a short grace period), and the parent
raises `LaunchError` naming that rank, with the remote traceback. Ranks are
started in their own process sessions so that killing one also kills anything
it started.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from cadence._util import job_secret as _job_secret
from cadence.errors import CadenceRuntimeError, CadenceValueError

__all__ = ["LaunchError", "RankFailure", "launch"]

_POLL_S = 0.02
_GRACE_S = 2.0
# How long the supervisor waits, once a rank failed, for others to show how they
# failed; see `_failed_ranks`.
_SETTLE_S = 0.5


@dataclass(frozen=True)
class RankFailure:
    """Why one rank failed."""

    rank: int
    reason: str  # "raised", "exited", "timeout"
    exit_code: int | None
    exc_type: str | None
    message: str
    traceback: str
    # The rank's process id, to match it with system logs or a core dump (the process
    # is gone by the time the error is raised).
    pid: int | None = None


class LaunchError(CadenceRuntimeError):
    """A launched rank raised, died or hung; every rank has been stopped."""

    def __init__(self, failure: RankFailure, others: list[RankFailure]) -> None:
        self.failure = failure
        self.rank = failure.rank
        self.others = others
        self.remote_traceback = failure.traceback
        super().__init__(self._describe())

    def _describe(self) -> str:
        f = self.failure
        if f.reason == "raised":
            head = f"rank {f.rank} raised {f.exc_type}: {f.message}"
        elif f.reason == "timeout":
            head = f"rank {f.rank} did not finish within the timeout ({f.message}); it may be hung in a collective"
        else:
            head = f"rank {f.rank} exited with code {f.exit_code} without raising a Python exception ({f.message})"
        lines = [head]
        if f.traceback:
            lines += ["", f"--- remote traceback (rank {f.rank}) ---", f.traceback.rstrip()]
        if self.others:
            lines += [
                "",
                "other ranks: " + "; ".join(f"rank {o.rank}: {o.reason}" for o in self.others),
            ]
        return "\n".join(lines)


class _Rank(Protocol):
    """What the supervisor needs of a rank: a ``subprocess.Popen`` or a `_warm.WarmRank`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def _loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux, "lo0" on BSD and macOS), if any.

    [Note: a local launch listens on loopback]
    Every rank of `launch` runs on this machine, yet gloo binds its listening sockets to
    the address this host's name resolves to, which on a cluster node is the address
    other machines reach. A peer there could connect to a rank's pairs (gloo does not
    authenticate them). ``GLOO_SOCKET_IFNAME`` set to the loopback interface keeps every
    socket of the job on the machine. A value the caller set (in the environment or
    ``env``) wins: that caller knows the network. NCCL's sockets are left to NCCL's own
    variables: its bootstrap is untested here without a GPU.
    """
    if not hasattr(socket, "if_nameindex"):
        return None
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reopen_closed_stdio() -> None:
    """Put the null device on descriptor 1 or 2 where the launcher's process closed it.

    Every rank writes to these two. Left closed, the launch's own first files or its
    warm server's socket would take the number, and the ranks would write into them.
    """
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)
            if null == fd:  # os.open's descriptors are not inherited; dup2's are
                os.set_inheritable(fd, True)
            else:
                os.dup2(null, fd)
                os.close(null)


def _dumps(obj: Any) -> bytes:
    # By value, so closures, lambdas and functions of ``__main__`` reach the ranks, which
    # cannot import them by name. Imported here: ``import cadence`` loads this module
    # eagerly and must stay cheap.
    from cadence.pickling import dumps

    return dumps(obj)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int,
    backend: str | None = None,
    timeout: float = 300.0,
    init_process_group: bool = True,
    num_threads: int | None = None,
    env: dict[str, str] | None = None,
    start: Literal["fresh", "warm"] = "fresh",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local ranks and return their results.

    Every rank writes to the launcher's descriptors 1 and 2, line-buffered: each line
    arrives whole and as soon as it ends, however many ranks print at once.

    Args:
        fn: any callable, closures and lambdas included.
        nprocs: number of ranks.
        backend: process-group backend (default: nccl with CUDA, else gloo).
        timeout: seconds for the whole run; past it every rank is stopped.
        init_process_group: initialise the default group (via ``cadence.init``)
            before calling ``fn``. Otherwise only the torchrun variables are set.
        num_threads: ``torch.set_num_threads`` in each rank (tests use 1).
        env: extra environment variables for the ranks. ``CADENCE_JOB_SECRET`` is a
            new secret per launch unless set here.
        start: ``"fresh"``, each rank a new interpreter; or ``"warm"``, each rank
            forked from a server that has imported torch once (about 2 s less per
            rank; a test suite's choice; see [Note: warm ranks] in
            ``cadence/_warm.py``). Environment read when torch is imported is then
            the server's, taken when it started.

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        LaunchError: a rank raised, exited or hung; all ranks were stopped.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise CadenceValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if start not in ("fresh", "warm"):
        raise CadenceValueError(f'start must be "fresh" or "warm", got {start!r}')
    _reopen_closed_stdio()
    # mkdtemp makes the folder 0700, owned by this user, under a name nobody could
    # guess and create first: ranks unpickle what is in it.
    with tempfile.TemporaryDirectory(prefix="cadence-launch-") as tmp:
        work = Path(tmp)
        (work / "payload.pkl").write_bytes(_dumps((fn, args, kwargs)))
        header = {
            "sys_path": list(sys.path),
            "init": init_process_group,
            "backend": backend,
            "timeout": timeout,
            "num_threads": num_threads,
        }
        (work / "header.pkl").write_bytes(pickle.dumps(header))
        port = _free_port()
        base_env = dict(os.environ)
        # Every launch its own: an inherited one (a launch from inside a rank) is not.
        base_env[_job_secret.ENV_VAR] = _job_secret.new()
        base_env.update(env or {})
        base_env.update(
            {
                "WORLD_SIZE": str(nprocs),
                "LOCAL_WORLD_SIZE": str(nprocs),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                # A file rendezvous: no port race between concurrent launches.
                "CADENCE_INIT_METHOD": f"file://{work / 'rendezvous'}",
            }
        )
        loopback = _loopback_interface()
        if loopback is not None:  # see [Note: a local launch listens on loopback]
            base_env.setdefault("GLOO_SOCKET_IFNAME", loopback)
        if num_threads is not None:
            base_env["OMP_NUM_THREADS"] = str(num_threads)
        procs: list[_Rank] = []
        try:
            for rank in range(nprocs):
                rank_env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
                if start == "warm":
                    from cadence import _warm

                    procs.append(_warm.WarmRank(work, rank, rank_env))
                    continue
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "cadence._worker", str(work), str(rank)],
                        env=rank_env,
                        start_new_session=True,
                    )
                )
            _supervise(procs, work, timeout)
        finally:
            _stop_all(procs)
        results = []
        for rank in range(nprocs):
            results.append(pickle.loads((work / f"result.{rank}").read_bytes()))
        return results


def _failure_of(rank: int, proc: _Rank, work: Path) -> RankFailure:
    err = work / f"error.{rank}"
    if err.exists():
        info = pickle.loads(err.read_bytes())
        return RankFailure(
            rank,
            "raised",
            proc.returncode,
            info["type"],
            info["message"],
            info["traceback"],
            proc.pid,
        )
    code = proc.returncode
    why = f"killed by signal {-code}" if code is not None and code < 0 else "os._exit or a crash"
    return RankFailure(rank, "exited", code, None, why, "", proc.pid)


def _failed_at(work: Path, rank: int) -> float:
    """When the rank failed, on the machine-wide monotonic clock.

    Taken from the error payload (recorded when the exception was caught), not the
    file's mtime, whose kernel clock is too coarse to order two ranks failing
    milliseconds apart. A rank that died without a payload (os._exit, a signal, a
    crash) comes first: ranks whose collectives broke because of it raise normally.
    """
    err = work / f"error.{rank}"
    if err.exists():
        try:
            return float(pickle.loads(err.read_bytes()).get("when", time.monotonic()))
        except Exception:
            return time.monotonic()
    return float("-inf")


def _poll(procs: list[_Rank], work: Path) -> tuple[list[int], list[int]]:
    """(running ranks, failed ranks). A rank that wrote its error is failed even while
    it is still tearing down."""
    running, failed = [], []
    for rank, proc in enumerate(procs):
        code = proc.poll()
        if (work / f"error.{rank}").exists() or (code is not None and code != 0):
            failed.append(rank)
        if code is None:
            running.append(rank)
    return running, failed


def _failed_ranks(procs: list[_Rank], work: Path) -> list[int]:
    """Every failed rank, after a short settling time.

    A SIGKILLed rank closes its sockets before its exit status can be read, so its
    peers can raise "Connection reset by peer" and write their errors while it still
    looks alive: without the wait, the peer would be blamed for the death.
    """
    time.sleep(_SETTLE_S)
    return _poll(procs, work)[1]


def _supervise(procs: list[_Rank], work: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        running, failed = _poll(procs, work)
        if failed:
            failed = _failed_ranks(procs, work)
            # The rank that failed first is the cause; ranks whose collectives broke
            # because of it fail moments later.
            first_rank = min(failed, key=lambda r: _failed_at(work, r))
            first = _failure_of(first_rank, procs[first_rank], work)
            _stop_all(procs)
            others = [
                _failure_of(r, p, work)
                if (work / f"error.{r}").exists()
                else RankFailure(r, "stopped by the launcher", p.returncode, None, "", "", p.pid)
                for r, p in enumerate(procs)
                if r != first_rank and p.returncode not in (0, None)
            ]
            others.sort(key=lambda f: f.reason != "raised")
            raise LaunchError(first, others)
        if not running:
            return
        if time.monotonic() > deadline:
            _stop_all(procs)
            failures = [
                RankFailure(r, "timeout", None, None, f"{timeout:.0f}s", "", procs[r].pid)
                for r in running
            ]
            raise LaunchError(failures[0], failures[1:])
        time.sleep(_POLL_S)


def _stop_all(procs: list[_Rank]) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        _signal_group(p, signal.SIGTERM)
    end = time.monotonic() + _GRACE_S
    for p in alive:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()
    # Anything the ranks started in their sessions goes too.
    for p in procs:
        _signal_group(p, signal.SIGKILL)


def _signal_group(proc: _Rank, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
