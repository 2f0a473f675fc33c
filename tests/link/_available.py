"""Whether this machine can make an emulated link, and why not: the tests that need
one skip with that reason, never run unshaped."""

from __future__ import annotations

import functools

from cadence.link import EmulatedLink, LinkSpec, LinkUnavailableError


@functools.cache
def unavailable() -> str | None:
    """None where a shaped link can be made here, else the one-line reason."""
    try:
        with EmulatedLink(LinkSpec.parse("100mbit")):
            return None
    except LinkUnavailableError as e:
        return str(e)


def netem_refusal() -> str | None:
    """None where ``delay=`` works here, else the refusal's message."""
    try:
        with EmulatedLink(LinkSpec.parse("100mbit,delay=1")):
            return None
    except LinkUnavailableError as e:
        return str(e)
