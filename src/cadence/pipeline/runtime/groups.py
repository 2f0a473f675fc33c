"""Pipeline channels -> process groups: the plan vote, creation, preconnect, cache.

A *channel* is a directed pair ``(src, dst)`` of pipeline ranks (positions in the
pp group) taken from the lowered schedule's SENDs; see [Note: channels come from
the SENDs] in ``schedule/channels.py``. Which communicator carries a transfer
depends on the plan's mode:

- ``per_directed_edge`` (default): each channel its own two-rank group, so
  unrelated edges never share a FIFO;
- ``per_direction``: two groups per pp group, each over all its ranks, ``pp_fwd``
  for activations and ``pp_bwd`` for gradients (see [Note: per-direction
  communicators] in ``schedule/channels.py``); a transfer's route is its channel
  *and* its payload;
- ``shared``: the pp group itself.

[Note: why the vote goes first]
``new_group`` is a collective over the default group and ``split_group`` over its
parent: if ranks disagree on the channel list they call it a different number of
times and hang inside the constructor. So every rank first votes, before any group
exists: one `Comm.agree` over the world on the digest of its plan (the one digest
of [Note: one plan, one digest]), its ``agree`` options and every pp group's ranks,
with its local setup error as a flag ([Note: agreeing by digest] in ``comm.py``).
That costs each rank the same few bytes at any world size, and unpickles nothing.
Only when the digests differ or some rank has an error do the ranks exchange the
details (``(plan, pp ranks, local error, options)`` as JSON) so that every rank
raises the same `PlanMismatchError`, naming the ranks and what differs.

[Note: where the pp groups come from]
Every rank creates every pp group's channel groups, so it must know them all.
`PipelineRuntime` passes them from the topology (``pp_groups``), and a pipeline
over the whole world has one; they are part of the voted digest, so ranks that
disagree fail in the vote. A caller that gives neither makes the ranks exchange
their pp ranks (world x a pp group per rank, once per plan).

[Note: every pp group, every rank]
With data parallelism there are several pp groups (pp=2 x dp=2 at world 4 has
{0,2} and {1,3}). ``new_group`` is collective over the *world*, so every rank
creates the channel groups of every pp group, in one canonical order (pp groups
sorted, then channels in round order), and keeps only its own.

Where the default group's backend can split (`cadence.topology.can_split`: NCCL
with a bound device, gloo from torch 2.15), one ``split_group`` per disjoint round,
each round's pairs covering all pp groups at once, since a rank appears in at most
one pair per round: the world collectives of a build are the plan's rounds, whatever
the number of pp groups (data-parallel replicas). Per direction: one ``split_group``
per direction whose splits are all the pp groups (they are disjoint). Elsewhere
(gloo on torch 2.13, where a group is a store rendezvous and a non-member's call
costs microseconds) one ``new_group(ranks=[a, b])`` per directed edge of every pp
group, and per direction ``new_group(ranks=pp)`` for the forward and then the
backward group of each pp group in turn. The NCCL paths follow upstream's algorithm
and are only exercised where a GPU exists; the gloo split runs on the 2.15 lane.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from cadence.comm import Comm, EventLog
from cadence.pipeline.runtime.errors import PlanMismatchError
from cadence.pipeline.schedule.channels import ChannelPlan, describe_plan_difference
from cadence.pipeline.schedule.ir import Payload
from cadence.topology import can_split, subgroup_timeout

__all__ = ["ChannelGroups", "ChannelMode", "PlanMismatchError", "build_channel_groups"]

Channel = tuple[int, int]
Route = tuple[Channel, Payload]  # a transfer's channel and what it carries
ChannelMode = Literal["per_directed_edge", "per_direction", "shared"]
# The per-direction groups in creation order: (name, the payload it carries).
_DIRECTIONS = (("fwd", Payload.ACT), ("bwd", Payload.GRAD))


@dataclass
class ChannelGroups:
    """This rank's channel communicators, keyed by (directed pp-rank pair, payload)."""

    pp_rank: int
    pp_ranks: tuple[int, ...]
    plan: ChannelPlan
    groups: dict[Route, dist.ProcessGroup] = field(default_factory=dict)
    all_pp_groups: tuple[tuple[int, ...], ...] = ()  # every pp group's ranks, sorted

    def comms(self, event_log: EventLog | None = None) -> dict[Route, tuple[Comm, int]]:
        """``{(channel, payload): (Comm, peer group rank)}`` for this rank's routes.

        Events are named after the channel (``"pp0->1"``), and in ``per_direction``
        mode also the direction group (``"pp0->1/fwd"``). Both payloads of one
        channel share one `Comm` when they share a communicator.
        """
        out: dict[Route, tuple[Comm, int]] = {}
        made: dict[tuple[Channel, int], tuple[Comm, int]] = {}
        for (ch, payload), group in self.groups.items():
            src, dst = ch
            key = (ch, id(group))
            if key not in made:
                peer_global = self.pp_ranks[dst if self.pp_rank == src else src]
                suffix = ""
                if self.plan.mode == "per_direction":
                    suffix = "/fwd" if payload is Payload.ACT else "/bwd"
                comm = Comm(group, event_log=event_log, name=f"pp{src}->{dst}{suffix}")
                made[key] = (comm, _group_rank(group, peer_global, comm))
            out[(ch, payload)] = made[key]
        return out


def _group_rank(group: dist.ProcessGroup, global_rank: int, comm: Comm) -> int:
    # Two-member groups are sorted by global rank, so the peer is the other slot;
    # in larger ones (the shared pp group, the per-direction groups) ask torch.
    if comm.world_size == 2:
        return 1 - comm.rank
    return dist.get_group_rank(group, global_rank)


# Cache: world group -> {(pp groups, channels, rounds, payloads, mode, backend):
#                        {(global pair, payload): group}}.
# Keyed weakly on the world group so a destroyed process group drops its entries.
_CACHE: weakref.WeakKeyDictionary[
    dist.ProcessGroup | None, dict[tuple[Any, ...], dict[Route, dist.ProcessGroup]]
] = weakref.WeakKeyDictionary()


def build_channel_groups(
    plan: ChannelPlan,
    *,
    pp_ranks: Sequence[int],
    pp_group: dist.ProcessGroup | None = None,
    preconnect: bool = True,
    event_log: EventLog | None = None,
    local_error: str | None = None,
    agree: object = None,
    pp_groups: Sequence[Sequence[int]] | None = None,
) -> ChannelGroups:
    """Vote on the plan on every rank, then create (or reuse) and preconnect the groups.

    Collective over the default group: every rank calls it with its own pp group's
    ranks and its `ChannelPlan` (any mode of ``CHANNEL_MODES``). ``local_error``: a
    misuse this rank found while setting up; it travels with the vote so that
    *every* rank raises it instead of the healthy ranks waiting for this one in a
    collective. ``agree``: a further value (with a
    stable ``repr``) every rank must have passed alike, checked in the same vote.
    ``pp_groups``: every pp group's ranks, each in pipeline order (the topology's
    ``groups_of("pp")``); see [Note: where the pp groups come from].
    See [Note: why the vote goes first].
    """
    world = Comm(None, event_log=event_log, name="pp-setup")
    pp_ranks_t = tuple(int(r) for r in pp_ranks)
    me = dist.get_rank()
    if me not in pp_ranks_t:
        local_error = local_error or f"rank {me} is not in its own pp_ranks {list(pp_ranks_t)}"
    known = _known_pp_groups(pp_groups, pp_ranks_t, world.world_size)
    if known is not None and pp_ranks_t not in known:
        local_error = local_error or (
            f"pp_ranks {list(pp_ranks_t)} is not one of the pp groups {[list(g) for g in known]}"
        )
    # -- 1. the vote, before any group (see [Note: why the vote goes first])
    mine = {
        "plan": plan.to_json(),
        "agree": repr(agree),
        "pp_groups": None if known is None else [list(g) for g in known],
    }
    canonical = json.dumps(mine, sort_keys=True).encode()
    vote = world.agree(canonical, flags=(local_error is not None, known is None))
    if not vote.same or any(vote.raised):
        details = {**mine, "pp": list(pp_ranks_t), "error": local_error}
        sent = world.all_gather_bytes(json.dumps(details, sort_keys=True).encode())
        known = _settle([json.loads(raw) for raw in sent])
    assert known is not None  # _settle raised, or every rank knows the same pp groups
    pp_groups_t = sorted(known)
    # -- 2. create (collective over the world, identical order on every rank)
    backend = str(dist.get_backend())
    # Payloads pick the groups only per direction (elsewhere both share a channel's).
    payloads = plan.payloads if plan.mode == "per_direction" else ()
    key = (tuple(pp_groups_t), plan.edges, plan.rounds, payloads, plan.mode, backend)
    per_world = _CACHE.setdefault(dist.group.WORLD, {})
    created = key in per_world
    if not created:
        per_world[key] = _create(pp_groups_t, plan, backend, pp_group)
    by_route = per_world[key]
    pp_rank = pp_ranks_t.index(me)
    groups = {
        (ch, payload): by_route[((pp_ranks_t[ch[0]], pp_ranks_t[ch[1]]), payload)]
        for ch, payload in _routes(plan)
        if pp_rank in ch
    }
    result = ChannelGroups(pp_rank, pp_ranks_t, plan, groups, tuple(pp_groups_t))
    # -- 3. preconnect, so no communicator is first used inside step()
    if preconnect and not created:
        _preconnect(result, world, event_log)
    return result


def _known_pp_groups(
    given: Sequence[Sequence[int]] | None, pp_ranks: tuple[int, ...], world_size: int
) -> tuple[tuple[int, ...], ...] | None:
    """Every pp group, sorted, when this rank can tell without asking the others."""
    if given is not None:
        return tuple(sorted(tuple(int(r) for r in g) for g in given))
    if sorted(pp_ranks) == list(range(world_size)):
        return (pp_ranks,)  # one pipeline over the whole world
    return None


def _settle(everyone: list[dict[str, Any]]) -> tuple[tuple[int, ...], ...]:
    """Raise the setup's `PlanMismatchError` (the same on every rank), or the pp groups.

    ``everyone``: each rank's details, exchanged because the vote found a difference,
    an error, or a rank that could not tell the pp groups.
    """
    errors = [(r, e["error"]) for r, e in enumerate(everyone) if e["error"]]
    agreed = {e["agree"] for e in everyone}
    if not errors and len(agreed) > 1:
        errors = [
            (r, f"pipeline options differ across ranks: {e['agree']}")
            for r, e in enumerate(everyone)
        ]
    if errors:
        raise PlanMismatchError(
            "pipeline setup failed (no group was created):\n"
            + "\n".join(f"  rank {r}: {msg}" for r, msg in errors)
        )
    _check_plans([(e["plan"], tuple(e["pp"])) for e in everyone])
    gathered = tuple(sorted({tuple(e["pp"]) for e in everyone}))
    named = {r: e["pp_groups"] for r, e in enumerate(everyone) if e["pp_groups"] is not None}
    wrong = {r: g for r, g in named.items() if tuple(tuple(x) for x in g) != gathered}
    if wrong:
        raise PlanMismatchError(
            "pipeline setup failed (no group was created): the pp groups ranks named "
            f"differ from their pp ranks {[list(g) for g in gathered]}:\n"
            + "\n".join(f"  rank {r}: pp groups {g}" for r, g in wrong.items())
            + "\nPass every rank the same topology's pp groups."
        )
    return gathered


def _check_plans(everyone: list[tuple[str, tuple[int, ...]]]) -> None:
    """Raise `PlanMismatchError` unless every rank sent the same plan (JSON, in rank order)."""
    digests: dict[str, list[int]] = {}
    for rank, (text, _) in enumerate(everyone):
        digests.setdefault(_digest(text), []).append(rank)
    if len(digests) == 1:
        return
    ref_text = everyone[0][0]
    ref = _plan_of(ref_text)
    lines = ["pipeline plans differ across ranks (no group was created):"]
    for digest, ranks in digests.items():
        lines.append(f"  digest {digest[:12]} on ranks {ranks}")
    for rank, (text, pp) in enumerate(everyone):
        if text != ref_text:
            theirs = _plan_of(text)
            if ref is None or theirs is None:
                diff = "its plan is in another format (another cadence version?)"
            else:
                diff = describe_plan_difference(ref, theirs, their_rank=rank, my_rank=0)
            lines.append(f"  rank {rank} (pp ranks {list(pp)}): {diff}")
    lines.append(
        "Every rank must build the same schedule (same generator, pp degree, "
        "microbatches, chunks and placement)."
    )
    raise PlanMismatchError("\n".join(lines))


def _digest(text: str) -> str:
    # The plan's own digest is the SHA-256 of its JSON: the same, without rebuilding it.
    return hashlib.sha256(text.encode()).hexdigest()


def _plan_of(text: str) -> ChannelPlan | None:
    """A peer's plan from its JSON, to describe how it differs (None: unreadable here)."""
    try:
        d = json.loads(text)
        return ChannelPlan(
            edges=tuple((int(a), int(b)) for a, b in d["edges"]),
            rounds=tuple(tuple((int(a), int(b)) for a, b in rd) for rd in d["rounds"]),
            placement=tuple(int(r) for r in d["placement"]),
            mode=str(d["mode"]),
            actions=str(d["actions"]),
            payloads=tuple((int(a), int(b), str(w)) for a, b, w in d["payloads"]),
        )
    except (KeyError, TypeError, ValueError):  # ScheduleValidationError is a ValueError
        return None


def _routes(plan: ChannelPlan) -> list[Route]:
    """Every (channel, payload) route of the plan, in creation order.

    Per direction, the payloads each channel carries; in the other modes both
    payloads of a channel share its communicator, so both are routed.
    """
    if plan.mode == "per_direction":
        carried = set(plan.payloads)
        return [
            (ch, p)
            for rd in plan.rounds
            for ch in rd
            for p, w in ((Payload.ACT, "act"), (Payload.GRAD, "grad"))
            if (*ch, w) in carried
        ]
    return [(ch, p) for rd in plan.rounds for ch in rd for p in (Payload.ACT, Payload.GRAD)]


def _create(
    pp_groups: list[tuple[int, ...]],
    plan: ChannelPlan,
    backend: str,
    pp_group: dist.ProcessGroup | None,
) -> dict[Route, dist.ProcessGroup]:
    """``{(global pair, payload): group}`` for every pp group's routes this rank is on."""
    routes = _routes(plan)
    me = dist.get_rank()
    out: dict[Route, dist.ProcessGroup] = {}

    def keep(pp: tuple[int, ...], pick: Callable[[Channel, Payload], dist.ProcessGroup]) -> None:
        for (a, b), payload in routes:
            pair = (pp[a], pp[b])
            if me in pair:
                out[(pair, payload)] = pick(pair, payload)

    split = can_split()
    timeout = subgroup_timeout()  # see [Note: subgroups wait as long as the world]
    if plan.mode == "shared":
        # One communicator for everything: the pp group itself (a baseline to compare).
        group = pp_group if pp_group is not None else dist.group.WORLD
        assert group is not None  # WORLD is None only before init_process_group
        for pp in pp_groups:
            keep(pp, lambda pair, p: group)
        return out
    if plan.mode == "per_direction":
        # Two groups per pp group over all of its ranks (see [Note: per-direction
        # communicators]); every rank creates every pp group's, in the same order.
        mine: dict[Payload, dist.ProcessGroup] = {}
        if split:
            # The pp groups are disjoint, so one split per direction covers them all.
            for name, payload in _DIRECTIONS:
                child = dist.split_group(
                    split_ranks=[sorted(pp) for pp in pp_groups],
                    group_desc=f"cadence_pp_{name}",
                    timeout=timeout,
                )
                if child is not None:
                    # split_group gives the ranks of a split a ProcessGroup (the others
                    # None or NON_GROUP_MEMBER, which torch's annotation adds).
                    mine[payload] = cast(dist.ProcessGroup, child)
        else:
            for pp in pp_groups:
                for _, payload in _DIRECTIONS:
                    made = dist.new_group(ranks=sorted(pp), timeout=timeout)
                    if me in pp:
                        # new_group gives its members a ProcessGroup (the others
                        # NON_GROUP_MEMBER, which torch's annotation adds).
                        mine[payload] = cast(dist.ProcessGroup, made)
        for pp in pp_groups:
            keep(pp, lambda pair, p: mine[p])
        return out
    by_pair: dict[Channel, dist.ProcessGroup] = {}
    if split:
        for i, rnd in enumerate(plan.rounds):
            pairs = [sorted((pp[a], pp[b])) for pp in pp_groups for a, b in rnd]
            child = dist.split_group(
                split_ranks=pairs, group_desc=f"cadence_pp_round_{i}", timeout=timeout
            )
            if child is None or me not in {r for pair in pairs for r in pair}:
                continue  # not in this round (torch 2.13 gives None, 2.15 NON_GROUP_MEMBER)
            for pp in pp_groups:
                for a, b in rnd:
                    pair = (pp[a], pp[b])
                    if me in pair:
                        # A ProcessGroup on the ranks of the split (see above).
                        by_pair[pair] = cast(dist.ProcessGroup, child)
    else:
        for pp in pp_groups:
            for rnd in plan.rounds:
                for a, b in rnd:
                    pair = (pp[a], pp[b])
                    made = dist.new_group(ranks=sorted(pair), timeout=timeout)
                    if me in pair:
                        # A ProcessGroup on its members (see above).
                        by_pair[pair] = cast(dist.ProcessGroup, made)
    for pp in pp_groups:
        keep(pp, lambda pair, p: by_pair[pair])
    return out


def _preconnect(cg: ChannelGroups, world: Comm, event_log: EventLog | None) -> None:
    comms = cg.comms(event_log)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if ("nccl" in world.backend and torch.cuda.is_available())
        else torch.device("cpu")
    )
    for rnd in cg.plan.rounds:
        # A rank is on at most one channel per round, so post and wait is safe; both
        # ends walk the channel's communicators in the same (payload) order.
        for ch in rnd:
            used: list[tuple[Comm, int]] = []
            for payload in (Payload.ACT, Payload.GRAD):
                route = comms.get((ch, payload))
                if route is not None and all(route[0] is not c for c, _ in used):
                    used.append(route)
            for comm, peer in used:
                buf = torch.zeros(1, device=device)
                work = comm.isend(buf, peer) if ch[0] == cg.pp_rank else comm.irecv(buf, peer)
                work.wait()
        # Non-members must not race ahead into the next round while a pair is still
        # initialising its communicator (upstream's shared-mode rule).
        world.barrier()
