"""The self-check's measurement, run as a script inside the namespace.

``python -m cadence.link._probe NBYTES`` sends NBYTES over one TCP connection on
127.0.0.1 and times them at the receiver (first byte to last), then times small
round trips; it prints one JSON line. Standard library only, so it starts in a
fraction of a second and measures the link, not an import.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import threading
import time

CHUNK = 1 << 20
ROUND_TRIPS = 20


def _receive(server: socket.socket, nbytes: int, out: dict[str, float]) -> None:
    conn, _ = server.accept()
    with conn:
        got, first = 0, None
        while got < nbytes:
            data = conn.recv(CHUNK)
            if not data:
                break
            if first is None:
                first = time.perf_counter()
            got += len(data)
        out["seconds"] = time.perf_counter() - (first or time.perf_counter())
        out["bytes"] = got
        conn.sendall(b"k")


def _echo(server: socket.socket) -> None:
    conn, _ = server.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(1):
            conn.sendall(data)


def measure(nbytes: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with socket.create_server(("127.0.0.1", 0)) as server:
        t = threading.Thread(target=_receive, args=(server, nbytes, out), daemon=True)
        t.start()
        with socket.create_connection(server.getsockname()) as c:
            block = b"\0" * CHUNK
            left = nbytes
            while left > 0:
                c.sendall(block[: min(left, CHUNK)])
                left -= CHUNK
            c.recv(1)  # the receiver has counted everything
        t.join()
    with socket.create_server(("127.0.0.1", 0)) as server:
        t = threading.Thread(target=_echo, args=(server,), daemon=True)
        t.start()
        rtts = []
        with socket.create_connection(server.getsockname()) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(ROUND_TRIPS):
                t0 = time.perf_counter()
                c.sendall(b"x")
                c.recv(1)
                rtts.append(time.perf_counter() - t0)
        t.join()
    # Bits on the wire over the receiver's clock. The first chunk arrives at once
    # (the bucket starts full), which a transfer of half a second makes negligible.
    return {
        "bytes": out["bytes"],
        "seconds": out["seconds"],
        "rate_bps": 8 * out["bytes"] / out["seconds"] if out["seconds"] > 0 else float("inf"),
        "rtt_ms": 1e3 * statistics.median(rtts),
    }


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]))))
