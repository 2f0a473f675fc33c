"""A link's delay without ``sch_netem``: every packet held in user space for a while.

[Note: the delay line]
``tc qdisc ... netem delay`` is how a loopback gets a latency, but some kernels are
built without ``sch_netem`` (and without ``sch_fq``, which honours a departure time a
BPF program could set). Netfilter's queue is in most kernels: an ``iptables ... -j
NFQUEUE`` rule in the link's namespace hands each packet its ranks send to a process
that binds the queue, and the packet goes on only when that process gives it a
verdict. This module is that process. It asks for metadata only (no payload is
copied), notes each packet's arrival, and accepts the packets whose time has come
with one batch verdict ("every id up to N": ids rise in arrival order and every
packet waits the same time, so the packets due are always a prefix). A notification
lost to a full socket buffer therefore delays nothing forever: the next batch covers
it. The packet then meets the token bucket on ``lo``, as after netem: delay, then rate.

The delay is at least the one asked for: the wait is timed from when this process
reads the packet, and it wakes a little late. The link's self-check measures the
round trip, so what the ranks get is reported beside what was asked. If this process
dies, the queue has no listener and the kernel drops what the rule sends it (no
``--queue-bypass``): the ranks stall and their collectives time out, which says the
link broke; it never runs undelayed without saying so.

Run as ``python -m cadence.link._delay_line QUEUE DELAY_MS`` inside the namespace; it
prints ``ready`` once the queue is bound, before which the rule must not be added.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import struct
import sys
import time

__all__ = ["DelayLine", "main"]

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
SO_RCVBUFFORCE = 33
_SUBSYS_QUEUE = 3
_MSG_PACKET, _MSG_CONFIG, _MSG_VERDICT_BATCH = 0, 2, 3
_CFG_CMD, _CFG_PARAMS, _CFG_QUEUE_MAXLEN = 1, 2, 3
_CMD_BIND = 1
_COPY_META = 1
_PACKET_HDR, _VERDICT_HDR = 1, 2
_NF_ACCEPT = 1
_NLM_F_REQUEST, _NLM_F_ACK = 1, 4
_NLMSG_ERROR = 2
# The kernel's queue may hold this many packets waiting for a verdict (default 1024):
# a millisecond at a few Gbit/s of small packets stays far below it.
_QUEUE_MAXLEN = 1 << 20
_RCVBUF = 64 << 20


def _attr(kind: int, payload: bytes) -> bytes:
    body = struct.pack("=HH", 4 + len(payload), kind) + payload
    return body + b"\0" * (-len(body) % 4)


def _message(msg: int, queue: int, attrs: bytes, *, seq: int, ack: bool) -> bytes:
    nfgen = struct.pack("!BBH", socket.AF_UNSPEC, 0, queue)
    flags = _NLM_F_REQUEST | (_NLM_F_ACK if ack else 0)
    body = nfgen + attrs
    return struct.pack("=IHHII", 16 + len(body), (_SUBSYS_QUEUE << 8) | msg, flags, seq, 0) + body


def _packet_ids(data: bytes) -> list[int]:
    """The packet ids of every queue notification in one read; errors raise."""
    ids = []
    off = 0
    while off + 16 <= len(data):
        length, kind, _, _, _ = struct.unpack_from("=IHHII", data, off)
        if length < 16:
            break
        if kind == _NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, off + 16)
            if err:
                raise OSError(-err, f"netfilter queue: {os.strerror(-err)}")
        elif kind == (_SUBSYS_QUEUE << 8) | _MSG_PACKET:
            a = off + 20  # past nlmsghdr and nfgenmsg
            while a + 4 <= off + length:
                alen, akind = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                if akind & 0x7FFF == _PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, a + 4)[0])
                    break
                a += (alen + 3) & ~3
        off += (length + 3) & ~3
    return ids


class DelayLine:
    """Bound to one netfilter queue; `serve` holds each packet ``delay_s``."""

    def __init__(self, queue: int, delay_s: float) -> None:
        self.queue = queue
        self.delay_s = delay_s
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, _RCVBUF)
        except OSError:  # not privileged for FORCE: take what rmem_max allows
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
        self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        self.sock.bind((0, 0))
        self._seq = 0
        cmd = struct.pack("!BBH", _CMD_BIND, 0, socket.AF_UNSPEC)
        self._config(_attr(_CFG_CMD, cmd))
        params = struct.pack("!IB", 0, _COPY_META)  # no payload: the id is all it needs
        self._config(
            _attr(_CFG_PARAMS, params) + _attr(_CFG_QUEUE_MAXLEN, struct.pack("!I", _QUEUE_MAXLEN))
        )

    def _config(self, attrs: bytes) -> None:
        self._seq += 1
        self.sock.send(_message(_MSG_CONFIG, self.queue, attrs, seq=self._seq, ack=True))
        _packet_ids(self.sock.recv(65536))  # the ack: raises on an error

    def _accept_through(self, packet_id: int) -> None:
        self._seq += 1
        verdict = _attr(_VERDICT_HDR, struct.pack("!II", _NF_ACCEPT, packet_id))
        self.sock.send(_message(_MSG_VERDICT_BATCH, self.queue, verdict, seq=self._seq, ack=False))

    def serve(self) -> None:
        """Hold and release packets until killed."""
        waiting: collections.deque[tuple[float, int]] = collections.deque()
        self.sock.setblocking(False)
        while True:
            now = time.monotonic()
            timeout = max(0.0, waiting[0][0] - now) if waiting else None
            readable, _, _ = select.select([self.sock], [], [], timeout)
            if readable:
                now = time.monotonic()
                due = now + self.delay_s
                while True:
                    try:
                        data = self.sock.recv(1 << 20)
                    except BlockingIOError:
                        break
                    waiting.extend((due, i) for i in _packet_ids(data))
            now = time.monotonic()
            last = None
            while waiting and waiting[0][0] <= now:
                last = waiting.popleft()[1]
            if last is not None:
                self._accept_through(last)


def main(argv: list[str]) -> int:
    queue, delay_ms = int(argv[0]), float(argv[1])
    line = DelayLine(queue, delay_ms / 1e3)
    print("ready", flush=True)
    line.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
