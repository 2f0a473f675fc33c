"""Transfers posted ahead of the schedule: receives on per-edge channels, batched runs.

[Note: receive lookahead]
A RECV in a lowered list is posted where `order_comms` put it: after the computes
that end before its message is due, i.e. shortly before its consumer. On gloo a
send moves its bytes only once the matching receive is posted (the receiver
announces its buffer), and NCCL pairs them the same way, so a receive posted late
puts a handshake and the transfer on the consumer's critical path, every
microbatch. With one communicator per directed rank pair nothing else shares the
channel: on its receiving side it carries only this rank's RECVs, matched to the
sender's SENDs first to first (the FIFO pairing `verify` proved). Posting a
channel's receives earlier, in the same order, therefore cannot change which send
meets which receive, and posting never blocks; waits stay at the consumers. So the
runtime keeps the next ``K`` receives of each channel posted ahead of the list
(``recv_lookahead=K``, default 1): the first ``K`` at the start of the step, and
when the list reaches a RECV, those up to ``K`` past it. The cost is at most ``K``
receive buffers per channel allocated early. Measured (`cadence bench pp`, five
schedules at world 2 and 4, step time against torch pipelining, medians on a quiet
2-core machine): 0.90-1.03 posting in place, 0.78-0.95 with ``K = 1``; posting
every receive at the start of the step gained no more within the noise.

Not under ``per_direction`` or ``shared`` communicators: there several channels
share one communicator, whose operations run in posting order, and the one
global message order of `order_comms` is what keeps them free of deadlock; a
receive posted early would queue ahead of sends it must follow. Not with
``batch_p2p`` either: a batch already posts a whole run of transfers together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cadence.pipeline.runtime.errors import PipelineUsageError
from cadence.pipeline.schedule import Action, ActionKind

__all__ = ["RecvPlan", "check_lookahead", "p2p_runs", "recv_plan"]


@dataclass(frozen=True)
class RecvPlan:
    """Which RECVs (by index in the action list) to post, and when."""

    at_start: tuple[int, ...] = ()
    # RECV index -> the RECVs to have posted once the list reaches it (itself first).
    on_reach: dict[int, tuple[int, ...]] = field(default_factory=dict)


def recv_plan(
    actions: Sequence[Action], lookahead: int, channel: Callable[[Action], object]
) -> RecvPlan | None:
    """The `RecvPlan` of one action list, or None for ``lookahead == 0`` (post in place)."""
    if lookahead == 0:
        return None
    by_channel: dict[object, list[int]] = {}
    for i, a in enumerate(actions):
        if a.kind is ActionKind.RECV:
            by_channel.setdefault(channel(a), []).append(i)
    at_start: list[int] = []
    on_reach: dict[int, tuple[int, ...]] = {}
    for indices in by_channel.values():
        at_start.extend(indices[:lookahead])
        for pos, i in enumerate(indices):
            on_reach[i] = tuple(indices[pos : pos + lookahead + 1])
    return RecvPlan(tuple(sorted(at_start)), on_reach)


def p2p_runs(actions: Sequence[Action]) -> dict[int, tuple[Action, ...]]:
    """Index of each run's first SEND/RECV -> the run; later members -> ().

    What ``batch_p2p`` posts ahead: a whole run of transfers at its first action (see
    [Note: batched P2P] in ``executor.py``).
    """
    runs: dict[int, tuple[Action, ...]] = {}
    i = 0
    while i < len(actions):
        j = i
        while j < len(actions) and actions[j].kind in (ActionKind.SEND, ActionKind.RECV):
            j += 1
        if j > i:
            runs[i] = tuple(actions[i:j])
            runs.update({k: () for k in range(i + 1, j)})
            i = j
        else:
            i += 1
    return runs


def check_lookahead(k: int | None, channel_mode: str, batch_p2p: bool) -> int:
    """The lookahead to use: ``k``, or the default for the layout; misuse refused."""
    if k is None:
        return 1 if channel_mode == "per_directed_edge" and not batch_p2p else 0
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise PipelineUsageError(f"recv_lookahead={k!r}; use an int >= 0 (0 posts in place)")
    if k and channel_mode != "per_directed_edge":
        raise PipelineUsageError(
            f"recv_lookahead={k} with channel_mode={channel_mode!r}: channels that share a "
            "communicator must post in the schedule's one global message order; use "
            "recv_lookahead=0, or channel_mode='per_directed_edge'"
        )
    if k and batch_p2p:
        raise PipelineUsageError(
            f"recv_lookahead={k} with batch_p2p=True: a batch posts its run of transfers "
            "together; use one of the two"
        )
    return k
