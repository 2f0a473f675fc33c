"""The wire of an emulated link, sampled through one traced step: when it carried bytes.

A collective's bar in a timeline runs from its issue to the end of its wait, so it
cannot tell a reduction that finished early from one still crossing the wire, nor a
wire that idled because gloo's threads waited for a core from one that was full. The
link's byte counter can: every rank's bytes cross the namespace's one loopback, so
reading it every half millisecond during a step gives the wire's own timeline.
`WireSampler` takes those readings on a thread of rank 0 (only while tracing, never
in a timed step: the thread costs a little CPU and GIL), and `utilization` turns them
into the fraction of the link's rate used in each bin, which `_timeline` draws under
each variant's lane.
"""

from __future__ import annotations

import itertools
import threading
import time
from types import TracebackType

from cadence.link import loopback_bytes

__all__ = ["WireSampler", "utilization"]

_PERIOD_S = 0.0005
BIN_S = 0.002  # a few packets of 64 KiB at the rates the cases calibrate to


class WireSampler:
    """``with WireSampler(t0) as s: ...``: ``s.samples`` is ``[(seconds since t0,
    bytes since the start)]``: a reading on entry, one every half millisecond, and one
    on exit, so even a step shorter than the period has its two ends."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.samples: list[tuple[float, int]] = []
        self._b0 = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cadence-wire", daemon=True)

    def _read(self) -> None:
        self.samples.append((time.perf_counter() - self.t0, loopback_bytes() - self._b0))

    def _run(self) -> None:
        while not self._stop.wait(_PERIOD_S):
            self._read()

    def __enter__(self) -> WireSampler:
        self._b0 = loopback_bytes()
        self._read()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._read()  # the thread has stopped: no other writer


def utilization(
    samples: list[tuple[float, int]], rate_bps: float, bin_s: float = BIN_S
) -> list[tuple[float, float]]:
    """``[(bin start in seconds, fraction of the rate used)]`` per ``bin_s`` bin, from
    the first sample to the last; the bytes between two readings are spread evenly
    over the time between them."""
    if len(samples) < 2 or rate_bps <= 0:
        return []
    start, end = samples[0][0], samples[-1][0]
    n = max(1, int((end - start) / bin_s + 0.999))
    got = [0.0] * n
    for (ta, ba), (tb, bb) in itertools.pairwise(samples):
        if bb <= ba or tb <= ta:
            continue
        per_s = (bb - ba) / (tb - ta)
        t = ta
        while t < tb:
            i = min(n - 1, int((t - start) / bin_s))
            edge = min(tb, start + (i + 1) * bin_s)
            if edge <= t:  # the last bin absorbs a rounding remainder
                edge = tb
            got[i] += per_s * (edge - t)
            t = edge
    full = rate_bps / 8 * bin_s
    return [(start + i * bin_s, min(1.0, b / full)) for i, b in enumerate(got)]
