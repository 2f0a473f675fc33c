"""Parallel degrees and the named process groups built from them.

One `Topology` describes the degrees; `Topology.build()` turns it into a
`ParallelGroups` object that every wrapper receives explicitly. Nothing here is
stored in module globals, so two topologies can live in one process (tests do
this) and no code reads "the" data-parallel group from somewhere hidden.

Rank layout: ``rank = (pp_idx * dp_replicate + rep_idx) * dp_shard + shard_idx``.
Pipeline is outermost and shard innermost (as torchtitan), so shard groups are
contiguous ranks: on a node-major launch they stay inside a node, where the
all-gather / reduce-scatter traffic is heaviest.

What a wrapper's ``group=`` means is resolved from these groups in ``_groups/dp_layout.py``.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cadence.errors import CadenceRuntimeError, CadenceValueError

__all__ = [
    "Coords",
    "ParallelGroups",
    "Topology",
    "can_split",
    "group_device",
    "subgroup_timeout",
]


class Coords(NamedTuple):
    """A rank's position in the (pp, dp_replicate, dp_shard) grid."""

    pp: int
    dp_replicate: int
    dp_shard: int


@dataclass(frozen=True)
class Topology:
    """Degrees of parallelism; their product is the world size.

    Attributes:
        dp_replicate: replicas that all-reduce gradients (the "R" of HSDP, or plain DP).
        dp_shard: ranks that shard parameters (FSDP); 1 means no sharding.
        pp: pipeline ranks.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CadenceValueError(f"Topology.{name} must be a positive int, got {value!r}")

    @classmethod
    def data_parallel(cls, world_size: int) -> Topology:
        """Plain data parallelism over ``world_size`` ranks."""
        return cls(dp_replicate=world_size)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.pp

    @property
    def dp_size(self) -> int:
        """Ranks that hold the same pipeline stage (replicate x shard)."""
        return self.dp_replicate * self.dp_shard

    def validate(self, world_size: int) -> None:
        """Raise `CadenceValueError` (a ``ValueError``) with the numbers if the degrees do not cover ``world_size``."""
        if self.world_size != world_size:
            raise CadenceValueError(
                f"Topology degrees dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} "
                f"x pp={self.pp} = {self.world_size}, but the world size is {world_size}. "
                "Choose degrees whose product equals the number of launched ranks."
            )

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise CadenceValueError(f"rank {rank} is outside a topology of {self.world_size} ranks")
        shard = rank % self.dp_shard
        rep = (rank // self.dp_shard) % self.dp_replicate
        pp = rank // (self.dp_shard * self.dp_replicate)
        return Coords(pp, rep, shard)

    def rank_of(self, coords: Coords) -> int:
        pp, rep, shard = coords
        return (pp * self.dp_replicate + rep) * self.dp_shard + shard

    def dp_rank_of(self, rank: int) -> int:
        """Index of ``rank`` in its flattened data-parallel group (replicate-major)."""
        c = self.coords(rank)
        return c.dp_replicate * self.dp_shard + c.dp_shard

    def dp_ranks_of(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s data-parallel group, indexed by dp rank."""
        base = self.coords(rank).pp * self.dp_size
        return list(range(base, base + self.dp_size))

    def pp_ranks_of(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s pipeline group, indexed by pipeline position."""
        c = self.coords(rank)
        return [self.rank_of(Coords(i, c.dp_replicate, c.dp_shard)) for i in range(self.pp)]

    def local_slice(self, rank: int, global_batch: int) -> slice:
        """Rows of a global batch of ``global_batch`` that ``rank``'s replica trains on."""
        if global_batch % self.dp_size:
            raise CadenceValueError(
                f"a global batch of {global_batch} rows does not split over dp_size="
                f"{self.dp_size} replicas (dp_replicate={self.dp_replicate} x "
                f"dp_shard={self.dp_shard}); use a batch size divisible by {self.dp_size}"
            )
        share = global_batch // self.dp_size
        start = self.dp_rank_of(rank) * share
        return slice(start, start + share)

    def groups_of(self, dim: str) -> list[list[int]]:
        """All rank lists along ``dim`` ("pp", "dp_replicate", "dp_shard" or "dp"), canonical order.

        Every rank must create groups in this same order, since ``new_group`` is a
        collective over the default group.
        """
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard}
        if dim == "dp":
            out = []
            for pp in range(self.pp):
                out.append(
                    [
                        self.rank_of(Coords(pp, r, s))
                        for r in range(self.dp_replicate)
                        for s in range(self.dp_shard)
                    ]
                )
            return out
        if dim not in sizes:
            raise CadenceValueError(
                f"unknown topology dimension {dim!r}; use pp, dp_replicate, dp_shard or dp"
            )
        others = [d for d in ("pp", "dp_replicate", "dp_shard") if d != dim]
        out = []
        for fixed in itertools.product(*(range(sizes[d]) for d in others)):
            ranks = []
            for i in range(sizes[dim]):
                c = dict(zip(others, fixed))
                c[dim] = i
                ranks.append(self.rank_of(Coords(c["pp"], c["dp_replicate"], c["dp_shard"])))
            out.append(ranks)
        return out

    # [Note: groups by split, flat in the world]
    # ``new_group`` is collective over the whole default group: every rank calls it for
    # every group of every axis, members or not, so a layout costs W + W/p + ... calls
    # per rank, and on NCCL with a bound device each call is a world-wide communicator
    # split (members split, the others post a no-colour split). Where the default
    # group's backend can split (`can_split`: NCCL with a bound device; gloo from torch
    # 2.15), one ``split_group`` per axis creates all of that axis's groups at once:
    # at most four world collectives per build, whatever W. Elsewhere (gloo on torch
    # 2.13, where a group is made by store rendezvous and a non-member's call costs
    # microseconds) the per-group loop stays. Either way an axis whose groups are
    # exactly another axis's (``dp`` is ``dp_shard`` without replicas) gets that axis's
    # group object, not a second communicator over the same ranks, and an axis spanning
    # the whole world is the default group.
    def build(self, *, backend: str | None = None) -> ParallelGroups:
        """Create the named groups. Collective: every rank of the default group must call it.

        See [Note: groups by split, flat in the world].
        """
        if not dist.is_initialized():
            raise CadenceRuntimeError(
                "Topology.build() needs an initialised default process group; call cadence.init() "
                "(or torch.distributed.init_process_group) first."
            )
        self.validate(dist.get_world_size())
        rank = dist.get_rank()
        split = backend is None and can_split()
        made: dict[tuple[tuple[int, ...], ...], dist.ProcessGroup] = {}
        mine: dict[str, dist.ProcessGroup] = {}
        for dim in ("pp", "dp_replicate", "dp_shard", "dp"):
            groups = self.groups_of(dim)
            partition = tuple(tuple(ranks) for ranks in groups)
            if partition not in made:
                made[partition] = _create_axis(groups, rank, dim, split, backend)
            mine[dim] = made[partition]
        world = dist.group.WORLD
        assert world is not None  # initialised above
        return ParallelGroups(
            topology=self,
            rank=rank,
            world=world,
            pp=mine["pp"],
            dp_replicate=mine["dp_replicate"],
            dp_shard=mine["dp_shard"],
            dp=mine["dp"],
            device=group_device(),
        )


def subgroup_timeout(parent: dist.ProcessGroup | None = None) -> timedelta | None:
    """The timeout for a group made from ``parent`` (default: the world): the parent's own.

    [Note: subgroups wait as long as the world]
    A group made by ``new_group`` or ``split_group`` without ``timeout=`` gets torch's
    default (30 minutes for gloo, 10 for NCCL), not the timeout the default group was
    initialised with. So a rank hung in an HSDP replica all-reduce, a pipeline send or a
    checkpoint's gather would keep its peers waiting for half an hour, whatever
    `cadence.init`'s ``timeout`` or ``cadence train --collective-timeout`` said. Every
    group cadence makes passes this instead. torch keeps a group's timeout only in its
    backend's private ``options._timeout`` (torch 2.13 to 2.15); where that cannot be
    read, None (torch's default, as without it).
    """
    group = parent if parent is not None else dist.group.WORLD
    if group is None:
        return None
    try:
        timeout = group._get_backend(group_device(group)).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


def can_split() -> bool:
    """Whether ``split_group`` can split the default group here (see
    [Note: groups by split, flat in the world]): its backend says it supports splitting,
    and torch does not refuse a split of an unbound default group (torch 2.13 does)."""
    safe = getattr(dist.distributed_c10d, "_is_safe_to_split", None)
    if safe is not None and not safe():
        return False
    world = dist.group.WORLD
    assert world is not None
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl" and torch.cuda.is_available()
        else torch.device("cpu")
    )
    try:
        backend = world._get_backend(device)
    except RuntimeError:  # no backend for that device
        return False
    return bool(getattr(backend, "supports_splitting", False)) and hasattr(dist, "split_group")


def _create_axis(
    groups: list[list[int]], rank: int, dim: str, split: bool, backend: str | None
) -> dist.ProcessGroup:
    """This rank's group of one axis whose groups are ``groups`` (every rank calls it)."""
    if len(groups) == 1:  # the whole world: the default group, no new communicator
        assert dist.group.WORLD is not None
        return dist.group.WORLD
    if split:
        group = dist.split_group(
            split_ranks=groups, group_desc=f"cadence_{dim}", timeout=subgroup_timeout()
        )
    else:
        group = None
        for ranks in groups:
            created = dist.new_group(ranks=ranks, backend=backend, timeout=subgroup_timeout())
            if rank in ranks:
                group = created
    assert isinstance(group, dist.ProcessGroup), f"rank {rank} is in no {dim} group"
    return group


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a group's collectives run on: the current GPU under NCCL, else the CPU."""
    if torch.cuda.is_available() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups of one `Topology`, for one rank. Pass it to the wrappers."""

    topology: Topology
    rank: int
    world: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp_replicate: dist.ProcessGroup
    dp_shard: dist.ProcessGroup
    dp: dist.ProcessGroup
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def coords(self) -> Coords:
        return self.topology.coords(self.rank)

    # -- rank layout: every wrapper, the pipeline and the trainer ask these ----------

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline position (0 holds the first stage)."""
        return self.coords.pp

    @property
    def pp_size(self) -> int:
        return self.topology.pp

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline group, indexed by pipeline position."""
        return self.topology.pp_ranks_of(self.rank)

    @property
    def dp_rank(self) -> int:
        """This rank's index in the flattened data-parallel group (replicate-major)."""
        return self.topology.dp_rank_of(self.rank)

    @property
    def dp_size(self) -> int:
        return self.topology.dp_size

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group, indexed by ``dp_rank``."""
        return self.topology.dp_ranks_of(self.rank)

    def local_slice(self, global_batch: int) -> slice:
        """The rows of a global batch this rank's data-parallel replica trains on.

        Every pipeline group sees the same global batch; replica ``dp_rank`` takes the
        ``dp_rank``-th of ``dp_size`` equal slices, so a run is the same whatever the
        layout. Raises ``ValueError`` when the batch does not split evenly.
        """
        return self.topology.local_slice(self.rank, global_batch)

    @functools.cached_property
    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel `DeviceMesh` of this rank, built once over existing groups.

        1-D ``("dp_shard",)`` without replication, else 2-D
        ``("dp_replicate", "dp_shard")`` (HSDP). Creating it issues no collective: it
        wraps ``dp_replicate`` and ``dp_shard``, which `Topology.build` already made.
        """
        topo = self.topology
        if topo.dp_replicate == 1:
            return DeviceMesh.from_group(
                self.dp_shard, self.device.type, mesh_dim_names=("dp_shard",)
            )
        ranks = torch.tensor(self.dp_ranks).view(topo.dp_replicate, topo.dp_shard)
        return DeviceMesh.from_group(
            [self.dp_replicate, self.dp_shard],
            self.device.type,
            mesh=ranks,
            mesh_dim_names=("dp_replicate", "dp_shard"),
        )
