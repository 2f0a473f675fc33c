"""What link to emulate: a rate and a one-way delay, parsed from ``RATE[,delay=MS]``.

Torch-free and process-free: the command line is checked before any namespace or
rank exists.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from cadence.errors import CadenceValueError

__all__ = ["UNSHAPED", "LinkSpec"]

# The spelling that asks for a namespace whose loopback is left as fast as the kernel
# makes it: for counting the bytes a job puts on the wire, never for timing a link.
UNSHAPED = "unshaped"

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)\s*$", re.IGNORECASE)
_DELAY = re.compile(r"^\s*delay\s*=\s*(\d+(?:\.\d+)?)\s*(ms)?\s*$", re.IGNORECASE)
# tc cannot honour less than this on a loopback whose packets are up to 64 KiB: the
# token bucket must hold a whole packet, so a slower rate is only bursts and pauses.
MIN_RATE_BPS = 1_000_000
MAX_DELAY_MS = 10_000.0
_HINT = "write RATE[,delay=MS], e.g. 2gbit, 500mbit,delay=1 or 'unshaped'"


@dataclass(frozen=True)
class LinkSpec:
    """A link between every pair of ranks on this machine.

    ``rate_bps`` is bits per second, shared by every byte any rank sends (one queue in
    both directions, as the namespace's loopback is one device); ``None`` leaves the
    loopback unshaped. ``delay_ms`` is added once per packet, so a round trip takes
    twice it.
    """

    rate_bps: int | None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_bps is not None and (
            not isinstance(self.rate_bps, int) or self.rate_bps < MIN_RATE_BPS
        ):
            raise CadenceValueError(
                f"link rate {self.rate_bps!r} bit/s is below 1 Mbit/s, which a loopback "
                f"of 64 KiB packets cannot be shaped to; {_HINT}"
            )
        if not 0.0 <= float(self.delay_ms) <= MAX_DELAY_MS:
            raise CadenceValueError(
                f"link delay {self.delay_ms!r} ms is outside 0-{MAX_DELAY_MS:g} ms; {_HINT}"
            )
        if self.rate_bps is None and self.delay_ms:
            raise CadenceValueError(
                f"an unshaped link has no delay; give a rate with the delay ({_HINT})"
            )

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """``2gbit``, ``1.5gbit,delay=1``, ``500mbit,delay=0.5ms`` or ``unshaped``."""
        head, *rest = str(text).split(",")
        if head.strip().lower() == UNSHAPED:
            rate: int | None = None
        else:
            m = _RATE.match(head)
            if m is None:
                raise CadenceValueError(f"link rate {head.strip()!r} not understood; {_HINT}")
            rate = round(float(m.group(1)) * _UNITS[m.group(2).lower()])
        delay = 0.0
        for part in rest:
            d = _DELAY.match(part)
            if d is None:
                raise CadenceValueError(f"link option {part.strip()!r} not understood; {_HINT}")
            delay = float(d.group(1))
        return cls(rate, delay)

    @property
    def shaped(self) -> bool:
        return self.rate_bps is not None

    def describe(self) -> str:
        """``2 Gbit/s, 1 ms delay``: what a person reads."""
        if self.rate_bps is None:
            return "unshaped loopback"
        rate = _human_rate(self.rate_bps)
        return rate + (f", {self.delay_ms:g} ms delay" if self.delay_ms else "")

    def text(self) -> str:
        """The spelling `parse` reads back."""
        if self.rate_bps is None:
            return UNSHAPED
        return f"{self.rate_bps}bit" + (f",delay={self.delay_ms:g}" if self.delay_ms else "")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LinkSpec:
        raw = json.loads(text)
        return cls(raw["rate_bps"], float(raw["delay_ms"]))


def _human_rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6)):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:.4g} bit/s"
