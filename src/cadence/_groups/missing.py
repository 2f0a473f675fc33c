"""Which ranks stopped answering, asked of the job's store once a collective times out.

[Note: naming the rank that stopped answering]
A collective that times out tells a rank only that it waited: gloo and NCCL do not
say for whom. So when one times out, the rank writes ``cadence/timed-out/<step>/<rank>``
to the default group's store and then, for a short grace period, reads which ranks of
the world wrote theirs. Every rank that still answers is blocked in the same step and
reaches its own timeout at about the same moment; a rank that never writes is the one
that hung, was stopped, or lost its node. The message says so with that caveat (a
rank blocked elsewhere, in a longer chain of sends, may only be late).

Nothing is written while training goes well: the failing step pays once, so the
store's load per step does not grow with the world. The store may itself be the
casualty (rank 0's process or node hosts it): every operation here runs under a short
store timeout, and the answer is then that the store did not answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

__all__ = ["Missing", "missing_ranks"]

_PREFIX = "cadence/timed-out"


@dataclass(frozen=True)
class Missing:
    """What the store said: the ranks that did not report, or why it could not say."""

    ranks: tuple[int, ...] = ()
    store_failed: str | None = None

    def describe(self, grace_s: float) -> str:
        if self.store_failed is not None:
            return (
                "the job's store did not answer either, so no rank can be named (its "
                f"host, rank 0's process or node, may be the one that stopped): "
                f"{self.store_failed}"
            )
        if not self.ranks:
            return f"every rank reported the same timeout within {grace_s:g} s"
        return (
            f"rank(s) {list(self.ranks)} had not reported a timeout {grace_s:g} s later: "
            "the one that stopped answering is among them (hung, stopped, or its node lost)"
        )


def missing_ranks(step: int, *, grace_s: float = 2.0) -> Missing | None:
    """Report this rank's timeout in ``step`` and name the ranks that never report theirs.

    None when there is no default group or store to ask (one process, or a group
    built without one). See [Note: naming the rank that stopped answering].
    """
    if not dist.is_initialized():
        return None
    try:  # torch's private accessor, in 2.13 and 2.15; without it, nobody is named
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = [f"{_PREFIX}/{step}/{r}" for r in range(world)]
    try:
        # Bounded: a store whose host stopped would otherwise block for the job's timeout
        # (this process is ending with the error, so its store's timeout may change).
        store.set_timeout(timedelta(seconds=max(grace_s, 1.0)))
        store.set(keys[rank], "1")
        deadline = time.monotonic() + grace_s
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        return Missing(tuple(r for r, key in enumerate(keys) if not store.check([key])))
    except (RuntimeError, OSError) as exc:  # the store's own timeout or a lost connection
        return Missing(store_failed=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
