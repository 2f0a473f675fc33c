"""Moving one rank's artifact to the others without busy waiting or long collectives.

[Note: precompile waiting ranks]
While rank ``src`` compiles (seconds to minutes), the other ranks wait. Two things must
not happen: a waiting rank spinning a core (on a shared host the ranks fight for the
same cores the compile needs, and NCCL's host-side wait spins), and one collective
lasting the whole compile (it would hit the process group's timeout, and NCCL's
watchdog would abort the job). So:

* ``src`` compiles on its main thread while a heartbeat thread broadcasts a small status
  tensor (``COMPILING``) every `HEARTBEAT_S` seconds; each collective is short;
* a waiting rank posts the matching broadcast asynchronously and sleeps in between
  polls of ``is_completed()`` (1 ms doubling to 50 ms), so it uses almost no CPU;
* the last status is ``READY`` with the payload length (then the payload follows) or
  ``FAILED`` with an error message (then every rank raises, none hangs).

The heartbeat thread is joined before ``src`` sends the final status, so the order of
collectives is the same on every rank.

[Note: precompile transport key]
The artifact ``src`` broadcasts is signed, and a receiving rank verifies the tag
before it unpickles a byte, with the job's secret ([Note: the job secret]): from
``CADENCE_JOB_SECRET`` when every rank has it (`cadence.launch` sets it), otherwise
drawn by ``src`` (32 random bytes) and broadcast to the group before the first
artifact, once per process group (`Channel.group_secret`). The second way keeps out
anyone who cannot see the group's traffic, no more: whoever can read it learns the
secret, whoever can write into it could already feed torch.distributed anything. Ranks
must agree on which way, or one would wait for an exchange the others skip, so every
rank reports whether it has the variable as a flag of the first vote (a digest
all-reduce: see [Note: agreeing by digest]), and a group that disagrees is refused on
every rank. The details that follow a difference travel as JSON, not a pickle: no rank
unpickles anything a peer sent before a tag has verified.
"""

from __future__ import annotations

import ctypes
import json
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cadence._util.job_secret import SECRET_BYTES
from cadence.comm import Comm, EventLog
from cadence.precompiling._errors import PrecompileError

__all__ = ["HEARTBEAT_S", "Channel"]

HEARTBEAT_S = 10.0
_COMPILING, _READY, _FAILED = 0, 1, 2
_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.05
# The secret each process group agreed on without CADENCE_JOB_SECRET; dropped with the
# group. See [Note: precompile transport key].
_GROUP_SECRETS: weakref.WeakKeyDictionary[Any, bytes] = weakref.WeakKeyDictionary()


def _sleep_until_done(work: Any) -> None:
    delay = _POLL_MIN_S
    while not work.is_completed():
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)
    work.wait()


class Channel:
    """The collectives of one precompile call, over one group (group ranks throughout)."""

    def __init__(self, group: Any, src: int, event_log: EventLog | None) -> None:
        self.group = group
        self.comm = Comm(group, event_log=event_log, name="precompile")
        self.rank = self.comm.rank
        self.world_size = self.comm.world_size
        self.src = src
        nccl = "nccl" in self.comm.backend
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        )

    def gather(self, obj: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``obj``, as JSON: nothing a peer sends here is unpickled."""
        data = json.dumps(obj, sort_keys=True).encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        self.comm.all_gather_single(sizes, size)
        longest = int(sizes.max())
        mine = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = torch.empty(longest * self.world_size, dtype=torch.uint8, device=self.device)
        self.comm.all_gather_single(every, mine)
        every = every.cpu().contiguous()
        raw = ctypes.string_at(every.data_ptr(), every.numel())
        return [
            json.loads(raw[r * longest : r * longest + int(n)])
            for r, n in enumerate(sizes.tolist())
        ]

    def group_secret(self) -> bytes:
        """The secret this group agreed on: drawn by ``src`` and broadcast the first time.

        A collective the first time for a group; every rank must call it at the same
        point. See [Note: precompile transport key].
        """
        known = _GROUP_SECRETS.get(self.group)
        if known is None:
            mine = secrets.token_bytes(SECRET_BYTES) if self.rank == self.src else None
            known = self._bytes(mine, SECRET_BYTES)
            _GROUP_SECRETS[self.group] = known
        return known

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        _sleep_until_done(self.comm.broadcast(tensor, src=self.src, async_op=True))
        return tensor

    def _status(self, status: int = 0, value: int = 0) -> tuple[int, int]:
        t = torch.tensor([status, value], dtype=torch.int64, device=self.device)
        out = self._broadcast(t).cpu()
        return int(out[0]), int(out[1])

    def _bytes(self, data: bytes | None, size: int) -> bytes:
        if size == 0:  # both sides know the size from the status: nothing to send
            return b""
        if data is None:
            t = torch.empty(size, dtype=torch.uint8, device=self.device)
        else:
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        out = self._broadcast(t).cpu().contiguous()
        return ctypes.string_at(out.data_ptr(), size)

    def send(self, produce: Callable[[], bytes]) -> bytes:
        """On ``src``: run ``produce`` with heartbeats, then broadcast its bytes (or its error)."""
        stop = threading.Event()
        failure: list[BaseException] = []
        device = self.device

        def heartbeat() -> None:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            try:
                while not stop.wait(HEARTBEAT_S):
                    self._status(_COMPILING)
            except BaseException as exc:  # the group broke: report it on the main thread
                failure.append(exc)

        thread = threading.Thread(target=heartbeat, name="cadence-precompile-heartbeat")
        thread.start()
        try:
            data = produce()
        except BaseException as exc:
            stop.set()
            thread.join()
            message = f"{type(exc).__name__}: {exc}".encode()[:65536]
            if not failure:
                self._status(_FAILED, len(message))
                self._bytes(message, len(message))
            raise
        stop.set()
        thread.join()
        if failure:
            raise PrecompileError("a heartbeat collective failed") from failure[0]
        self._status(_READY, len(data))
        self._bytes(data, len(data))
        return data

    def receive(self) -> bytes:
        """On every other rank: wait (asleep) for ``src``'s bytes; raise its error if it failed."""
        while True:
            status, size = self._status()
            if status == _COMPILING:
                continue
            payload = self._bytes(None, size)
            if status == _READY:
                return payload
            raise PrecompileError(
                f"rank {self.src} of the group failed to precompile, so no rank can load: "
                + payload.decode(errors="replace")
            )


def default_group() -> Any | None:
    """The world group when torch.distributed is initialized, else None (one process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None
