"""Pipeline channels -> process groups: the plan vote, creation, preconnect, cache.

A *channel* is a directed pair ``(src, dst)`` of pipeline ranks (positions in the
pp group) taken from the lowered schedule's SENDs; see [Note: channels come from
the SENDs] in ``schedule/channels.py``. Each channel gets its own communicator, so
unrelated edges never share a FIFO.

[Note: why the vote goes first]
``new_group`` is a collective over the default group and ``split_group`` over its
parent: if ranks disagree on the channel list they call it a different number of
times and hang inside the constructor. So every rank first all-gathers its
``(ChannelPlan, pp ranks, local setup error)`` over the world and compares the
plans' digests (the one digest of [Note: one plan, one digest]); a mismatch, or
any rank's local error, raises `PlanMismatchError` on every rank, naming the ranks
and what differs, before any group exists.

[Note: every pp group, every rank]
With data parallelism there are several pp groups (pp=2 x dp=2 at world 4 has
{0,2} and {1,3}). ``new_group`` is collective over the *world*, so every rank
creates the channel groups of every pp group, in one canonical order (pp groups
sorted, then channels in round order), and keeps only its own.

On gloo one ``new_group(ranks=[a, b])`` per directed edge (``split_group`` is
NCCL-only in torch 2.13). On NCCL one ``split_group`` per disjoint round, each
round's pairs covering all pp groups at once, since a rank appears in at most one
pair per round. The NCCL path is written to upstream's algorithm and is only
exercised where a GPU exists.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from cadence.comm import Comm, EventLog
from cadence.pipeline.runtime.errors import PlanMismatchError
from cadence.pipeline.schedule.channels import (
    RUNTIME_CHANNEL_MODES,
    ChannelPlan,
    describe_plan_difference,
)

__all__ = ["ChannelGroups", "ChannelMode", "PlanMismatchError", "build_channel_groups"]

Channel = tuple[int, int]
ChannelMode = Literal["per_directed_edge", "shared"]


@dataclass
class ChannelGroups:
    """This rank's channel communicators, keyed by directed pp-rank pair."""

    pp_rank: int
    pp_ranks: tuple[int, ...]
    plan: ChannelPlan
    groups: dict[Channel, dist.ProcessGroup] = field(default_factory=dict)
    all_pp_groups: tuple[tuple[int, ...], ...] = ()  # every pp group's ranks, sorted

    def comms(self, event_log: EventLog | None = None) -> dict[Channel, tuple[Comm, int]]:
        """``{channel: (Comm, peer group rank)}`` for the channels this rank is on."""
        out: dict[Channel, tuple[Comm, int]] = {}
        for ch in self.plan.edges:
            if self.pp_rank not in ch:
                continue
            src, dst = ch
            peer_global = self.pp_ranks[dst if self.pp_rank == src else src]
            group = self.groups[ch]
            comm = Comm(group, event_log=event_log, name=f"pp{src}->{dst}")
            out[ch] = (comm, _group_rank(group, peer_global, comm))
        return out


def _group_rank(group: dist.ProcessGroup, global_rank: int, comm: Comm) -> int:
    # Two-member groups are sorted by global rank, so the peer is the other slot;
    # for the shared pp group fall back to torch's lookup.
    if comm.world_size == 2:
        return 1 - comm.rank
    return dist.get_group_rank(group, global_rank)


# Cache: world group -> {(pp groups, channels, rounds, mode, backend): {global pair: group}}.
# Keyed weakly on the world group so a destroyed process group drops its entries.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def build_channel_groups(
    plan: ChannelPlan,
    *,
    pp_ranks: Sequence[int],
    pp_group: dist.ProcessGroup | None = None,
    preconnect: bool = True,
    event_log: EventLog | None = None,
    local_error: str | None = None,
    agree: object = None,
) -> ChannelGroups:
    """Vote on the plan on every rank, then create (or reuse) and preconnect the groups.

    Collective over the default group: every rank calls it with its own pp group's
    ranks and its `ChannelPlan` (whose ``mode`` must be ``"per_directed_edge"`` or
    ``"shared"``). ``local_error``: a misuse this rank found while setting up; it
    travels with the vote so that *every* rank raises it instead of the healthy
    ranks waiting for this one in a collective. ``agree``: a further value (with a
    stable ``repr``) every rank must have passed alike, checked in the same vote.
    See [Note: why the vote goes first].
    """
    world = Comm(None, event_log=event_log, name="pp-setup")
    pp_ranks_t = tuple(int(r) for r in pp_ranks)
    me = dist.get_rank()
    if me not in pp_ranks_t:
        local_error = local_error or f"rank {me} is not in its own pp_ranks {list(pp_ranks_t)}"
    if plan.mode not in RUNTIME_CHANNEL_MODES:
        local_error = local_error or (
            f"channel mode {plan.mode!r} has no communicators at run time; use one of "
            f"{RUNTIME_CHANNEL_MODES}"
        )
    # -- 1. the vote, before any group (see [Note: why the vote goes first])
    everyone = world.all_gather_object((plan, pp_ranks_t, local_error, repr(agree)))
    errors = [(r, err) for r, (_, _, err, _) in enumerate(everyone) if err]
    agreed = {a for *_, a in everyone}
    if not errors and len(agreed) > 1:
        errors = [
            (r, f"pipeline options differ across ranks: {a}") for r, (*_, a) in enumerate(everyone)
        ]
    if errors:
        raise PlanMismatchError(
            "pipeline setup failed (no group was created):\n"
            + "\n".join(f"  rank {r}: {msg}" for r, msg in errors)
        )
    _check_plans([(p, pp) for p, pp, _, _ in everyone])
    pp_groups = sorted({pp for _, pp, _, _ in everyone})
    # -- 2. create (collective over the world, identical order on every rank)
    backend = str(dist.get_backend())
    key = (tuple(pp_groups), plan.edges, plan.rounds, plan.mode, backend)
    per_world = _CACHE.setdefault(dist.group.WORLD, {})
    created = key in per_world
    if not created:
        per_world[key] = _create(pp_groups, plan, backend, pp_group)
    by_pair = per_world[key]
    pp_rank = pp_ranks_t.index(me)
    groups = {
        ch: by_pair[(pp_ranks_t[ch[0]], pp_ranks_t[ch[1]])] for ch in plan.edges if pp_rank in ch
    }
    result = ChannelGroups(pp_rank, pp_ranks_t, plan, groups, tuple(pp_groups))
    # -- 3. preconnect, so no communicator is first used inside step()
    if preconnect and not created:
        _preconnect(result, world, event_log)
    return result


def _check_plans(everyone: list[tuple[ChannelPlan, tuple[int, ...]]]) -> None:
    digests: dict[str, list[int]] = {}
    for rank, (plan, _) in enumerate(everyone):
        digests.setdefault(plan.digest, []).append(rank)
    if len(digests) == 1:
        return
    ref = everyone[0][0]
    lines = ["pipeline plans differ across ranks (no group was created):"]
    for digest, ranks in digests.items():
        lines.append(f"  digest {digest[:12]} on ranks {ranks}")
    for rank, (plan, pp) in enumerate(everyone):
        if plan.digest != ref.digest:
            diff = describe_plan_difference(ref, plan, their_rank=rank, my_rank=0)
            lines.append(f"  rank {rank} (pp ranks {list(pp)}): {diff}")
    lines.append(
        "Every rank must build the same schedule (same generator, pp degree, "
        "microbatches, chunks and placement)."
    )
    raise PlanMismatchError("\n".join(lines))


def _create(
    pp_groups: list[tuple[int, ...]],
    plan: ChannelPlan,
    backend: str,
    pp_group: dist.ProcessGroup | None,
) -> dict[Channel, dist.ProcessGroup]:
    by_pair: dict[Channel, dist.ProcessGroup] = {}
    chans, rounds = plan.edges, plan.rounds
    if plan.mode == "shared":
        # One communicator for everything: the pp group itself (a baseline to compare).
        for pp in pp_groups:
            for a, b in chans:
                by_pair[(pp[a], pp[b])] = pp_group if pp_group is not None else dist.group.WORLD
        return by_pair
    if "nccl" in backend and hasattr(dist, "split_group"):
        for i, rnd in enumerate(rounds):
            split = [sorted((pp[a], pp[b])) for pp in pp_groups for a, b in rnd]
            child = dist.split_group(split_ranks=split, group_desc=f"cadence_pp_round_{i}")
            if child is None:
                continue
            for pp in pp_groups:
                for a, b in rnd:
                    pair = (pp[a], pp[b])
                    if dist.get_rank() in pair:
                        by_pair[pair] = child
        return by_pair
    for pp in pp_groups:
        for rnd in rounds:
            for a, b in rnd:
                pair = (pp[a], pp[b])
                group = dist.new_group(ranks=sorted(pair))
                if dist.get_rank() in pair:
                    by_pair[pair] = group
    return by_pair


def _preconnect(cg: ChannelGroups, world: Comm, event_log: EventLog | None) -> None:
    comms = cg.comms(event_log)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if ("nccl" in world.backend and torch.cuda.is_available())
        else torch.device("cpu")
    )
    for rnd in cg.plan.rounds:
        # A rank is on at most one channel per round, so post and wait is safe.
        for ch in rnd:
            if ch not in comms:
                continue
            comm, peer = comms[ch]
            buf = torch.zeros(1, device=device)
            work = comm.isend(buf, peer) if ch[0] == cg.pp_rank else comm.irecv(buf, peer)
            work.wait()
        # Non-members must not race ahead into the next round while a pair is still
        # initialising its communicator (upstream's shared-mode rule).
        world.barrier()
