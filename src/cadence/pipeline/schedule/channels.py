"""P2P channels derived from a lowered schedule, and the canonical channel plan.

[Note: channels come from the SENDs]
A channel is a directed (src_rank, dst_rank) pair that some SEND of the lowered
schedule uses, and each channel gets its own communicator at run time. Deriving
channels from the SENDs rather than from the placement makes every edge the
schedule really uses appear, and only those: the looped wrap-around (rank p-1 ->
0) and skip connections fall out, while the V turn (two consecutive stages on one
rank) is a LOCAL and adds none. One communicator per directed pair means
unrelated edges never share a FIFO, so a receive can never wait behind sends it
does not depend on (the cross-edge hang the simulator's ``serialize`` mode shows
for shared or per-direction communicators).

[Note: one plan, one digest]
The plan is a pure function of the lowered schedule, so every rank computes the
same one from the same inputs whatever order it built them in: undirected pairs
sorted, greedily matched into disjoint rounds (no rank twice in a round, which
NCCL ``split_group`` requires), each round emitted as given and then reversed
(the algorithm of pytorch/pytorch#196666). Groups are created in plan order.
``ChannelPlan.digest`` hashes the plan, the placement, the mode, the format
version and the lowered action lists of every rank; it is the one value the
ranks vote on before any group exists, so a rank that built a different schedule
(other microbatches, another generator, another placement) fails the vote with
`describe_plan_difference` instead of hanging in a collective or exchanging
mismatched messages.

[Note: per-direction communicators]
In ``per_direction`` mode a pp group has two communicators over all its ranks:
``pp_fwd`` carries every activation (SEND_F/RECV_F) and ``pp_bwd`` every gradient
(SEND_B/RECV_B), whatever ranks a message goes between. The split is by payload,
not by rank order, because that is what the simulator serialises (its group of a
transfer in this mode is the transfer's payload) and so what ``order_comms``
proved deadlock-free; a rank-order split would put the looped wrap-around
activation (rank p-1 -> 0) and both directions of the V schedules' return leg on
the "backward" communicator, a layout nobody checked. A channel may therefore be
carried by both groups, so the plan records which payloads each channel carries
(``payloads``), and a ``per_direction`` plan must have them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cadence.pipeline.schedule._errors import ScheduleValidationError
from cadence.pipeline.schedule.ir import ActionKind, Payload, Schedule

__all__ = [
    "CHANNEL_MODES",
    "PLAN_FORMAT_VERSION",
    "ChannelPlan",
    "channel_plan",
    "derive_channels",
    "describe_plan_difference",
    "logical_edges",
    "plan_rounds",
]

PLAN_FORMAT_VERSION = 3
# Every communicator layout; the simulator models each and the runtime creates each.
CHANNEL_MODES = ("shared", "per_direction", "per_directed_edge")
_PAYLOADS = ("act", "grad")

Edge = tuple[int, int]


def derive_channels(sched: Schedule) -> tuple[Edge, ...]:
    """Sorted directed (src_rank, dst_rank) pairs used by the schedule's SENDs.

    See [Note: channels come from the SENDs].
    """
    out = set()
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            if a.kind is ActionKind.SEND:
                assert a.peer_stage is not None  # Action sets it for every transfer
                dst = sched.placement[a.peer_stage]
                if dst != r:
                    out.add((r, dst))
    return tuple(sorted(out))


def logical_edges(sched: Schedule) -> dict[Edge, tuple[tuple[int, int, str], ...]]:
    """channel -> the (src_stage, dst_stage, 'act'|'grad') logical edges it carries."""
    table: dict[Edge, set[tuple[int, int, str]]] = {}
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            if a.kind is ActionKind.SEND and a.peer_stage is not None:
                ch = (r, sched.placement[a.peer_stage])
                what = "act" if a.payload is Payload.ACT else "grad"
                table.setdefault(ch, set()).add((a.stage, a.peer_stage, what))
    return {ch: tuple(sorted(v)) for ch, v in sorted(table.items())}


def plan_rounds(edges: Iterable[Edge]) -> tuple[tuple[Edge, ...], ...]:
    """Greedy disjoint rounds over sorted undirected pairs, each as given then reversed.

    >>> plan_rounds([(0, 1), (1, 2), (2, 3), (3, 0), (1, 0), (2, 1), (3, 2), (0, 3)])
    (((0, 1), (2, 3)), ((1, 0), (3, 2)), ((0, 3), (1, 2)), ((3, 0), (2, 1)))
    """
    pairs = sorted({(min(a, b), max(a, b)) for a, b in edges if a != b})
    directed = set(edges)
    rounds: list[tuple[Edge, ...]] = []
    left = pairs
    while left:
        used: set[int] = set()
        this, rest = [], []
        for a, b in left:
            if a in used or b in used:
                rest.append((a, b))
            else:
                this.append((a, b))
                used |= {a, b}
        fwd = tuple(e for e in this if e in directed)
        bwd = tuple((b, a) for a, b in this if (b, a) in directed)
        rounds += [rd for rd in (fwd, bwd) if rd]
        left = rest
    return tuple(rounds)


@dataclass(frozen=True)
class ChannelPlan:
    """The canonical plan: channels, creation rounds, placement, mode and digest.

    Build it with `channel_plan` (from a lowered schedule) or `ChannelPlan.build`
    (from a channel set). See [Note: one plan, one digest].

    Attributes:
        edges: the directed (src_rank, dst_rank) channels, sorted.
        rounds: the creation rounds over ``edges`` (see `plan_rounds`).
        placement: ``placement[stage] = rank``.
        mode: one of ``CHANNEL_MODES``.
        actions: SHA-256 of the lowered action lists ("" when built from edges).
        payloads: sorted ``(src_rank, dst_rank, "act" | "grad")``: what each channel
            carries (from the SENDs; may be empty except in ``per_direction`` mode,
            see [Note: per-direction communicators]).
        digest: SHA-256 of everything above and the plan format version.
    """

    edges: tuple[Edge, ...]
    rounds: tuple[tuple[Edge, ...], ...]
    placement: tuple[int, ...]
    mode: str = "per_directed_edge"
    actions: str = ""
    payloads: tuple[tuple[int, int, str], ...] = ()
    digest: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.mode not in CHANNEL_MODES:
            raise ScheduleValidationError(
                f"channel mode must be one of {CHANNEL_MODES}, got {self.mode!r}"
            )
        flat = sorted(e for rd in self.rounds for e in rd)
        if flat != sorted(self.edges):
            raise ScheduleValidationError("ChannelPlan rounds must cover exactly its edges")
        carried = {(a, b) for a, b, _ in self.payloads}
        if self.payloads and (
            carried != set(self.edges)
            or any(w not in _PAYLOADS for *_, w in self.payloads)
            or list(self.payloads) != sorted(set(self.payloads))
        ):
            raise ScheduleValidationError(
                "ChannelPlan payloads must be sorted, unique (src, dst, 'act' | 'grad') "
                f"triples covering exactly its edges, got {self.payloads}"
            )
        if self.mode == "per_direction" and self.edges and not self.payloads:
            raise ScheduleValidationError(
                "a per_direction ChannelPlan needs the payloads its channels carry (the "
                "direction communicators split by payload); build it with "
                "channel_plan(lowered, 'per_direction') or ChannelPlan.build(..., payloads=...)"
            )
        # The digest is derived, never given: two plans with equal fields always agree.
        object.__setattr__(self, "digest", hashlib.sha256(self.to_json().encode()).hexdigest())

    @classmethod
    def build(
        cls,
        edges: Iterable[Edge],
        placement: Sequence[int],
        mode: str = "per_directed_edge",
        *,
        actions: str = "",
        payloads: Iterable[tuple[int, int, str]] = (),
    ) -> ChannelPlan:
        """The plan of a channel set (order-independent): sorted edges, canonical rounds."""
        es = tuple(sorted(set(edges)))
        pays = tuple(sorted(set(payloads)))
        return cls(es, plan_rounds(es), tuple(placement), mode, actions, pays)

    def groups(self) -> tuple[tuple[str, tuple[Edge, ...]], ...]:
        """(group name, channels it carries) in creation order, per mode.

        ``per_direction`` has both groups always (the runtime creates both), split by
        payload; see [Note: per-direction communicators].
        """
        if self.mode == "shared":
            return (("pp", self.edges),)
        if self.mode == "per_direction":
            return tuple(
                (f"pp_{name}", tuple(sorted({(a, b) for a, b, w in self.payloads if w == what})))
                for name, what in (("fwd", "act"), ("bwd", "grad"))
            )
        return tuple((f"pp{a}->{b}", ((a, b),)) for rd in self.rounds for a, b in rd)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": PLAN_FORMAT_VERSION,
                "edges": [list(e) for e in self.edges],
                "rounds": [[list(e) for e in rd] for rd in self.rounds],
                "placement": list(self.placement),
                "mode": self.mode,
                "actions": self.actions,
                "payloads": [list(t) for t in self.payloads],
            },
            sort_keys=True,
        )


def channel_plan(sched: Schedule, mode: str = "per_directed_edge") -> ChannelPlan:
    """The canonical `ChannelPlan` of a lowered schedule (order-independent)."""
    if not sched.meta.lowered:
        raise ScheduleValidationError(
            "channel_plan needs a lowered schedule (channels come from its SENDs)"
        )
    text = json.dumps([[str(a) for a in acts] for acts in sched.ranks])
    actions = hashlib.sha256(text.encode()).hexdigest()
    payloads = {
        (a, b, what) for (a, b), logical in logical_edges(sched).items() for *_, what in logical
    }
    return ChannelPlan.build(
        derive_channels(sched), sched.placement, mode, actions=actions, payloads=payloads
    )


def describe_plan_difference(
    mine: ChannelPlan,
    theirs: ChannelPlan,
    *,
    their_rank: int | None = None,
    my_rank: int | None = None,
) -> str:
    """A readable description of how two plans differ ('' if they are equal)."""
    who = "the other rank" if their_rank is None else f"rank {their_rank}"
    here = "here" if my_rank is None else f"on rank {my_rank}"
    diffs: list[str] = []
    if mine.placement != theirs.placement:
        stages = [
            s
            for s in range(max(len(mine.placement), len(theirs.placement)))
            if _at(mine.placement, s) != _at(theirs.placement, s)
        ]
        diffs.append(
            "placement differs at stages "
            + ", ".join(
                f"{s} (rank {_at(mine.placement, s)} {here}, "
                f"rank {_at(theirs.placement, s)} on {who})"
                for s in stages
            )
        )
    only_mine = sorted(set(mine.edges) - set(theirs.edges))
    only_theirs = sorted(set(theirs.edges) - set(mine.edges))
    if only_mine:
        diffs.append(f"channels only {here}: {_fmt(only_mine)}")
    if only_theirs:
        diffs.append(f"channels only on {who}: {_fmt(only_theirs)}")
    if mine.mode != theirs.mode:
        diffs.append(f"channel mode {here} {mine.mode!r}, on {who} {theirs.mode!r}")
    if not diffs and mine.actions != theirs.actions:
        diffs.append(
            f"same channels, but the lowered action lists differ from {who}'s (another "
            "generator, microbatch count or chunk count)"
        )
    if not diffs and mine.rounds != theirs.rounds:
        diffs.append("same channels but different creation rounds (a plan-format mismatch)")
    return "; ".join(diffs)


def _at(t: Sequence[int], i: int) -> int | None:
    return t[i] if i < len(t) else None


def _fmt(edges: Sequence[Edge]) -> str:
    return ", ".join(f"{a}->{b}" for a, b in edges)
