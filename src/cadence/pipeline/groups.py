"""Pipeline channels -> process groups: digest check, creation, preconnect, cache.

A *channel* is a directed pair ``(src, dst)`` of pipeline ranks (positions in the
pp group) taken from the lowered schedule's SENDs (``topology.py``). Each channel
gets its own communicator so that unrelated edges never share a FIFO
(pytorch/pytorch#195760, design note §1.2).

[Note: why the digest goes first]
``new_group`` is a collective over the default group and ``split_group`` over its
parent: if ranks disagree on the channel list they call it a different number of
times and hang inside the constructor. So every rank first all-gathers
``(digest, pp ranks, channels)`` over the world and compares; a mismatch raises
a ``PlanMismatchError`` naming the ranks and the channels that differ, on every
rank, before any group exists.

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

__all__ = [
    "ChannelGroups",
    "ChannelMode",
    "PlanMismatchError",
    "build_channel_groups",
    "canonical_rounds",
]

Channel = tuple[int, int]
ChannelMode = Literal["per_directed_edge", "shared"]


class PlanMismatchError(RuntimeError):
    """Ranks disagree on the pipeline plan; raised before any group is created."""


def canonical_rounds(channels: Sequence[Channel]) -> list[list[Channel]]:
    """Upstream's rounds: sorted undirected pairs, greedy disjoint matchings, each
    emitted as given and then reversed (only directions that exist are kept).

    A pure function of the channel *set*, so input order never matters.
    """
    directed = set(channels)
    pairs = sorted({(min(a, b), max(a, b)) for a, b in directed if a != b})
    rounds: list[list[Channel]] = []
    while pairs:
        used: set[int] = set()
        matching, rest = [], []
        for a, b in pairs:
            if a in used or b in used:
                rest.append((a, b))
            else:
                matching.append((a, b))
                used.update((a, b))
        pairs = rest
        for orient in (matching, [(b, a) for a, b in matching]):
            present = [e for e in orient if e in directed]
            if present:
                rounds.append(present)
    return rounds


@dataclass
class ChannelGroups:
    """This rank's channel communicators, keyed by directed pp-rank pair."""

    pp_rank: int
    pp_ranks: tuple[int, ...]
    channels: tuple[Channel, ...]
    rounds: tuple[tuple[Channel, ...], ...]
    mode: ChannelMode
    groups: dict[Channel, dist.ProcessGroup] = field(default_factory=dict)
    pp_group: dist.ProcessGroup | None = None

    def comms(self, event_log: EventLog | None = None) -> dict[Channel, tuple[Comm, int]]:
        """``{channel: (Comm, peer group rank)}`` for the channels this rank is on."""
        out: dict[Channel, tuple[Comm, int]] = {}
        for ch in self.channels:
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


# Cache: world group -> {(pp groups, channels, mode, backend): {global pair: group}}.
# Keyed weakly on the world group so a destroyed process group drops its entries.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def build_channel_groups(
    channels: Sequence[Channel],
    *,
    pp_ranks: Sequence[int],
    digest: str,
    mode: ChannelMode = "per_directed_edge",
    rounds: Sequence[Sequence[Channel]] | None = None,
    pp_group: dist.ProcessGroup | None = None,
    preconnect: bool = True,
    event_log: EventLog | None = None,
    local_error: str | None = None,
) -> ChannelGroups:
    """Check the plan on every rank, then create (or reuse) and preconnect the groups.

    Collective over the default group: every rank calls it with its own pp group's
    plan. ``digest`` is the plan's digest (placement + channels + version); it must
    be equal on every rank. ``local_error``: a misuse this rank found while setting
    up; it travels with the vote so that *every* rank raises it instead of the
    healthy ranks waiting for this one in a collective.
    """
    world = Comm(None, event_log=event_log, name="pp-setup")
    chans = tuple(sorted(set(channels)))
    rounds_t = tuple(tuple(r) for r in (rounds if rounds is not None else canonical_rounds(chans)))
    pp_ranks_t = tuple(int(r) for r in pp_ranks)
    me = dist.get_rank()
    if me not in pp_ranks_t:
        raise ValueError(f"rank {me} is not in its own pp_ranks {list(pp_ranks_t)}")
    # -- 1. the plan vote, before any group (see [Note: why the digest goes first])
    mine = (digest, pp_ranks_t, chans, mode, local_error)
    everyone = world.all_gather_object(mine)
    errors = [(r, e[4]) for r, e in enumerate(everyone) if e[4]]
    if errors:
        raise PlanMismatchError(
            "pipeline setup failed (no group was created):\n"
            + "\n".join(f"  rank {r}: {msg}" for r, msg in errors)
        )
    everyone = [e[:4] for e in everyone]
    _check_plans(everyone)
    pp_groups = sorted({p for _, p, _, _ in everyone})
    # -- 2. create (collective over the world, identical order on every rank)
    backend = str(dist.get_backend())
    key = (tuple(pp_groups), chans, rounds_t, mode, backend)
    per_world = _CACHE.setdefault(dist.group.WORLD, {})
    created = key in per_world
    if not created:
        per_world[key] = _create(pp_groups, chans, rounds_t, mode, backend, pp_group)
    by_pair = per_world[key]
    pp_rank = pp_ranks_t.index(me)
    groups = {}
    for ch in chans:
        if pp_rank in ch:
            groups[ch] = by_pair[(pp_ranks_t[ch[0]], pp_ranks_t[ch[1]])]
    result = ChannelGroups(pp_rank, pp_ranks_t, chans, rounds_t, mode, groups, pp_group)
    # -- 3. preconnect, so no communicator is first used inside step()
    if preconnect and not created:
        _preconnect(result, world, event_log)
    return result


def _check_plans(everyone: list[tuple]) -> None:
    digests = {}
    for rank, (digest, _, _, _) in enumerate(everyone):
        digests.setdefault(digest, []).append(rank)
    modes = {m for *_, m in everyone}
    if len(digests) == 1 and len(modes) == 1:
        return
    ref_digest, _, ref_ch, ref_mode = everyone[0]
    lines = ["pipeline plans differ across ranks (no group was created):"]
    for digest, ranks in digests.items():
        lines.append(f"  digest {digest[:12]} on ranks {ranks}")
    for rank, (digest, pp, ch, mode) in enumerate(everyone):
        if digest == ref_digest and mode == ref_mode:
            continue
        extra, missing = sorted(set(ch) - set(ref_ch)), sorted(set(ref_ch) - set(ch))
        lines.append(
            f"  rank {rank} (pp ranks {list(pp)}) vs rank 0: channels only on rank {rank}: "
            f"{extra}, only on rank 0: {missing}; mode {mode!r} vs {ref_mode!r}"
        )
    lines.append(
        "Every rank must build the same schedule (same generator, pp degree, "
        "microbatches, chunks and placement)."
    )
    raise PlanMismatchError("\n".join(lines))


def _create(pp_groups, chans, rounds, mode, backend, pp_group):
    by_pair: dict[tuple[int, int], dist.ProcessGroup] = {}
    if mode == "shared":
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
    for rnd in cg.rounds:
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
