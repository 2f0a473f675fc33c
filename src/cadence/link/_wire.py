"""What a process inside an emulated link can read of it: the link it runs on and the
bytes that have crossed its wire.

`EmulatedLink.run` tells the commands it starts which link they run on through
``CADENCE_LINK`` (the spec and the rate the self-check measured), so a benchmark
inside can record it beside its figures and turn bytes into wire time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from cadence.link._spec import LinkSpec

__all__ = ["ENV_VAR", "ActiveLink", "active_link", "loopback_bytes"]

ENV_VAR = "CADENCE_LINK"


@dataclass(frozen=True)
class ActiveLink:
    """The link this process runs on: as asked, and as the self-check measured it."""

    spec: LinkSpec
    namespace: str
    measured_bps: float | None  # None: unshaped, or not measured
    rtt_ms: float | None

    def to_env(self) -> str:
        return json.dumps(
            {
                "spec": json.loads(self.spec.to_json()),
                "namespace": self.namespace,
                "measured_bps": self.measured_bps,
                "rtt_ms": self.rtt_ms,
            }
        )

    def as_settings(self) -> dict[str, object]:
        """The fields a benchmark record keeps."""
        return {
            "link": self.spec.text(),
            "link_rate_asked_bps": self.spec.rate_bps,
            "link_rate_measured_bps": self.measured_bps,
            "link_delay_ms": self.spec.delay_ms,
            "link_rtt_ms": self.rtt_ms,
        }


def active_link() -> ActiveLink | None:
    """The link this process was started on by `EmulatedLink.run`, or None."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return None
    d = json.loads(raw)
    spec = LinkSpec(d["spec"]["rate_bps"], float(d["spec"]["delay_ms"]))
    return ActiveLink(spec, d["namespace"], d["measured_bps"], d["rtt_ms"])


def loopback_bytes(proc_net_dev: Path = Path("/proc/self/net/dev")) -> int:
    """Bytes sent on this network namespace's loopback since it was made.

    Inside an emulated link every byte between ranks crosses ``lo`` once (its egress is
    the shaped queue), so the difference of two readings is what the ranks put on the
    wire in between, all of them together. ``/proc/self/net/dev`` is this process's
    namespace's table (``/proc/net/dev`` would be too, through the symlink).
    """
    for line in proc_net_dev.read_text().splitlines():
        name, sep, fields = line.partition(":")
        if sep and name.strip() == "lo":
            # receive: bytes packets errs drop fifo frame compressed multicast;
            # transmit: bytes ...
            return int(fields.split()[8])
    raise RuntimeError(f"no 'lo' line in {proc_net_dev}")
