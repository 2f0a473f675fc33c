"""An emulated cluster link on one machine, for benchmarks, tests and users.

``cadence bench KIND --link RATE[,delay=MS]`` and ``cadence link RATE -- COMMAND``
run ranks inside a network namespace whose loopback is shaped to ``RATE`` with ``tc``,
so communication takes wire time while the cores stay free, as on a cluster. See
``docs/link.md``.

    from cadence.link import EmulatedLink, LinkSpec

    with EmulatedLink(LinkSpec.parse("1gbit,delay=0.5")) as link:
        print(link.self_check().line(link.spec))
        link.run(["torchrun", "--nproc-per-node", "2", "train.py"])
"""

from __future__ import annotations

from cadence.link._errors import LinkUnavailableError
from cadence.link._netns import EmulatedLink, LinkMeasurement, remove_stale
from cadence.link._spec import UNSHAPED, LinkSpec
from cadence.link._wire import ActiveLink, active_link, loopback_bytes

__all__ = [
    "UNSHAPED",
    "ActiveLink",
    "EmulatedLink",
    "LinkMeasurement",
    "LinkSpec",
    "LinkUnavailableError",
    "active_link",
    "loopback_bytes",
    "remove_stale",
]
