"""What a data-parallel wrapper's ``group=`` means: `DataParallelLayout`.

`DataParallelLayout.of` is the one place where a wrapper's ``group=`` argument is
given its meaning (see [Note: the meaning of group=]): DataParallel and fully_shard
both resolve it here, from a process group, a `ParallelGroups`, a torch `DeviceMesh`
or nothing (the world). It reads `ParallelGroups`; ``topology.py`` knows nothing of
it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from cadence.errors import CadenceRuntimeError, CadenceTypeError, CadenceValueError
from cadence.topology import ParallelGroups, group_device

__all__ = ["DataParallelGroup", "DataParallelLayout"]


DataParallelGroup: TypeAlias = dist.ProcessGroup | ParallelGroups | DeviceMesh | None
"""What a data-parallel wrapper's ``group=`` accepts (see `DataParallelLayout.of`)."""


@dataclass(frozen=True)
class DataParallelLayout:
    """The data-parallel groups one wrapper reduces over, resolved from its ``group=``.

    [Note: the meaning of group=]
    ``group=`` names the data-parallel group a wrapper reduces gradients over, and
    means the same on every wrapper. It is resolved here and nowhere else:

    - ``None``: the whole world, one flat group.
    - a ``ProcessGroup``: that flat group (this rank must be a member).
    - a `ParallelGroups`: its data-parallel axes. fully_shard shards over
      ``dp_shard`` and, when ``dp_replicate > 1``, replicates over ``dp_replicate``
      (HSDP); DataParallel all-reduces over the flattened ``dp`` group. Pipeline
      ranks are never part of it: each pipeline position has its own dp group.
    - a torch ``DeviceMesh``: 1-D is a flat group; 2-D is ``(replicate, shard)``,
      HSDP for fully_shard and flattened for DataParallel (torch's own meshes say
      the same: FSDP2 reads a 2-D mesh as HSDP).

    Anything else is refused with a `CadenceTypeError` listing these forms, before
    any collective. One resolver keeps the meaning from drifting apart between
    wrappers: a rank layout computed twice is a rank layout that can disagree.

    Attributes:
        shard_group: the group fully_shard shards over (a flat group's whole self).
        replicate_group: HSDP replicas (the mesh's first dimension), or None.
        mesh: 1-D ``(shard,)`` or 2-D ``(replicate, shard)``, for the DTensor shards.
        device: where the collectives run (the current GPU under NCCL, else the CPU).
        flat_group: the flattened replicate x shard group when it is known up front
            (`ParallelGroups.dp`); otherwise `dp_group` derives it from the mesh.
    """

    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    mesh: DeviceMesh
    device: torch.device
    flat_group: dist.ProcessGroup | None = field(default=None, repr=False)

    @classmethod
    def of(cls, group: DataParallelGroup, *, who: str = "group=") -> DataParallelLayout:
        """Resolve a wrapper's ``group=``; ``who`` names the wrapper in error messages."""
        if isinstance(group, ParallelGroups):
            return cls._of_parallel_groups(group)
        if group is not None and not isinstance(group, (dist.ProcessGroup, DeviceMesh)):
            raise CadenceTypeError(
                f"{who} got group={type(group).__name__}; it accepts None (the world), a "
                "torch.distributed.ProcessGroup, a cadence.ParallelGroups (its dp axes) or a "
                "torch DeviceMesh with 1 dim (flat) or 2 dims (replicate, shard)."
            )
        if not dist.is_initialized():
            raise CadenceRuntimeError(
                f"{who} needs an initialised process group; call cadence.init() first "
                "(or run under cadence.launch / torchrun)."
            )
        if isinstance(group, DeviceMesh):
            return cls._of_mesh(group, who)
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        if dist.get_rank(pg) < 0:
            raise CadenceValueError(
                f"{who}: rank {dist.get_rank()} is not a member of the process group "
                "passed as group=; pass a group that contains every calling rank."
            )
        device = group_device(pg)
        # No dimension names: torch compares DeviceMeshes by value (ranks, layout,
        # device, names), so the world group's mesh is equal to the one FSDP2 builds by
        # default (init_device_mesh(device, (world,))), and per-rank state dicts and
        # optimizer states cross-load between the two (docs/fsdp.md, "Per-rank state
        # dicts across torch FSDP2 and cadence").
        mesh = DeviceMesh.from_group(pg, device.type)
        return cls(shard_group=pg, replicate_group=None, mesh=mesh, device=device)

    @classmethod
    def _of_parallel_groups(cls, groups: ParallelGroups) -> DataParallelLayout:
        """fully_shard shards over ``dp_shard`` and, when ``dp_replicate > 1``, replicates
        over ``dp_replicate`` (HSDP); DataParallel all-reduces over ``dp``. The mesh is
        the one `ParallelGroups.dp_mesh` built once, so every wrapper shares it."""
        hsdp = groups.topology.dp_replicate > 1
        return cls(
            shard_group=groups.dp_shard,
            replicate_group=groups.dp_replicate if hsdp else None,
            mesh=groups.dp_mesh,
            device=groups.device,
            flat_group=groups.dp,
        )

    @classmethod
    def _of_mesh(cls, mesh: DeviceMesh, who: str) -> DataParallelLayout:
        if mesh.ndim not in (1, 2):
            raise CadenceValueError(
                f"{who} got a {mesh.ndim}-D DeviceMesh; data parallelism uses a 1-D mesh "
                "(flat) or a 2-D mesh (replicate, shard). Pass the data-parallel submesh, "
                'e.g. mesh["dp_replicate", "dp_shard"].'
            )
        if mesh.get_coordinate() is None:
            raise CadenceValueError(
                f"{who}: rank {dist.get_rank()} is not part of the DeviceMesh passed as "
                "group=; every calling rank must be in it."
            )
        if mesh.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device(mesh.device_type)
        if mesh.ndim == 1:
            return cls(
                shard_group=mesh.get_group(0), replicate_group=None, mesh=mesh, device=device
            )
        return cls(
            shard_group=mesh.get_group(1),
            replicate_group=mesh.get_group(0),
            mesh=mesh,
            device=device,
        )

    @property
    def placements(self) -> tuple[Placement, ...]:
        """DTensor placements of a sharded parameter: ``Shard(0)``, replicated under HSDP."""
        return (Shard(0),) if self.replicate_group is None else (Replicate(), Shard(0))

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard_group)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)

    def dp_group(self) -> dist.ProcessGroup:
        """The flattened replicate x shard group: what DataParallel all-reduces over.

        A 2-D mesh that covers the whole world flattens to the default group (no new
        communicator). A smaller one is flattened by torch's ``DeviceMesh._flatten``,
        which creates the flat groups of every mesh slice, so it is collective over
        the world, like ``new_group``, and happens once per mesh (torch caches it).
        """
        if self.replicate_group is None:
            return self.shard_group
        if self.flat_group is not None:
            return self.flat_group
        if self.mesh.size() == dist.get_world_size():
            assert dist.group.WORLD is not None
            return dist.group.WORLD
        if self.mesh.mesh_dim_names is None:
            raise CadenceValueError(
                "DataParallel must flatten the 2-D DeviceMesh passed as group=, and torch "
                "flattens only meshes with dimension names; create it with "
                'mesh_dim_names=("dp_replicate", "dp_shard").'
            )
        return self.mesh._flatten().get_group()
