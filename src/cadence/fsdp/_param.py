"""Per-parameter sharding: dim-0 chunks padded to chunk 0's size, in one flat shard per unit.

[Note: cadence FSDP tensors]
Shape legend: ``W`` = shard-group size, ``S`` = padded shard numel of a unit
(sum over its params of ``chunk_rows * row_numel``).

- ``flat_shard``  (S,)   1D, original dtype. Parameter ``p``'s padded chunk sits at
  ``[offset, offset + chunk_numel)``; its valid rows are the first ``local_rows``.
  The optimizer's sharded parameter is a DTensor ``Shard(0)`` whose local tensor is a
  *view* of that slice, so in-place optimizer updates land in ``flat_shard`` and the
  all-gather needs no copy-in (FSDP2 copies each shard in).
- all-gather output (W, S) rank-major; copied out per parameter into
- ``unsharded_flat`` (W*S,) parameter-major: ``p`` owns ``[W*offset, W*(offset+chunk_numel))``,
  viewed (W, chunk_numel); the unsharded parameter is its first ``numel`` elements.
  Row-major rank order puts all padding at the tail, so a prefix view is exact.
- reduce-scatter input (W, S) rank-major, built by ``torch._chunk_cat`` (which pads the
  same way), output (S,); ``p``'s sharded grad is a view of its valid slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from cadence.fsdp._cross_load import install_optimizer_check
from cadence.fsdp._errors import FullyShardError, FullyShardValueError
from cadence.fsdp._ties import Owners, tie_error

__all__ = ["ParamInfo", "collect_params", "make_layout", "picklable_shards_hook"]


@dataclass
class ParamInfo:
    """One (deduplicated) parameter of a unit and where its pieces live."""

    fqn: str
    registrations: list[tuple[nn.Module, str]]
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    # -- layout (filled by make_layout) --
    row_numel: int = 0
    chunk_rows: int = 0
    chunk_numel: int = 0  # padded, per rank
    offset: int = 0  # into flat_shard
    local_rows: int = 0
    # -- tensors --
    sharded: nn.Parameter | None = None  # DTensor Shard(0), what the optimizer sees
    # ``sharded``'s local tensor as seated (a view of the flat shard): when the object
    # holds another one, something replaced it; see [Note: parameters replaced after sharding].
    local: torch.Tensor | None = None
    unsharded: nn.Parameter | None = None  # view into the unit's unsharded_flat

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel

    def local_shape(self) -> torch.Size:
        return torch.Size([self.local_rows, *self.shape[1:]])

    def register(self, tensor: nn.Parameter) -> None:
        # Write module._parameters directly: the module may hold a DTensor or a plain
        # Parameter under the same name at different times (state-dict keys never change).
        for module, name in self.registrations:
            module._parameters[name] = tensor


def _is_unit(module: nn.Module) -> bool:
    return getattr(module, "_cadence_unit", None) is not None


def collect_params(root: nn.Module, *, ignored: set[int] | None = None) -> list[ParamInfo]:
    """Params of ``root`` not owned by a nested unit; ties inside are merged, across raise.

    ``ignored``: ids of parameters to leave alone (FSDP2's ``ignored_params``).
    """
    by_id: dict[int, ParamInfo] = {}  # every object is alive (held by a module) meanwhile
    owners = Owners()
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        prefix, module = stack.pop()
        for name, p in list(module._parameters.items()):
            if p is None or (ignored and id(p) in ignored):
                continue
            fqn = f"{prefix}{name}"
            # Already sharded by another unit, nested or not: [Note: parameter identity
            # across units] in _ties.py (by object, never by a reused id()).
            owner = owners.of(p)
            if owner is not None:
                raise tie_error(fqn, owner, root)
            if isinstance(p, DTensor):
                # Not one of cadence's shards (those are found above): tensor parallelism's
                # (parallelize_module) or torch's own fully_shard's.
                raise FullyShardError(
                    f"parameter {fqn!r} is already a DTensor {tuple(p.placements)} on "
                    f"{p.device_mesh}, made by tensor parallelism (parallelize_module) or "
                    "by torch's fully_shard: cadence's fully_shard shards plain tensors and "
                    "does not compose with tensor parallelism. Fix: apply it to a model "
                    "without DTensor parameters (data parallel or HSDP only), or use "
                    "torch's fully_shard for TP + FSDP."
                )
            if p.dim() == 0:  # FSDP2 raises ValueError too
                raise FullyShardValueError(
                    f"parameter {fqn!r} is 0-dimensional and cannot be sharded on dim 0; "
                    "give it shape (1,) instead."
                )
            info = by_id.get(id(p))
            if info is None:
                info = by_id[id(p)] = ParamInfo(fqn, [], p.shape, p.dtype, p.requires_grad)
            info.registrations.append((module, name))
        for child_name, child in reversed(list(module._modules.items())):
            if child is not None and not _is_unit(child):
                stack.append((f"{prefix}{child_name}.", child))
    return list(by_id.values())


def make_layout(params: list[ParamInfo], world: int, rank: int) -> int:
    """Fill each param's chunk geometry (torch.chunk semantics, as DTensor); return S."""
    offset = 0
    for info in params:
        dim0 = info.shape[0]
        info.row_numel = math.prod(info.shape[1:])
        info.chunk_rows = math.ceil(dim0 / world)
        info.chunk_numel = info.chunk_rows * info.row_numel
        info.local_rows = max(0, min(dim0, (rank + 1) * info.chunk_rows) - rank * info.chunk_rows)
        info.offset = offset
        offset += info.chunk_numel
    return offset


def make_sharded_param(
    info: ParamInfo,
    flat_shard: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
) -> nn.Parameter:
    local = flat_shard.narrow(0, info.offset, info.local_numel).view(info.local_shape())
    dt = DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=info.shape,
        stride=torch.empty(info.shape, device="meta").stride(),
    )
    install_optimizer_check()  # [Note: per-rank state dicts across meshes]
    return nn.Parameter(dt, requires_grad=info.requires_grad)


def _offset_free(t: DTensor) -> DTensor:
    """The same DTensor (same local view, no copy) behind a wrapper with storage offset 0.

    [Note: picklable shards]
    A sharded parameter's local tensor is a view into the unit's flat shard, so it
    starts at a storage offset. ``DTensor.from_local`` (and every DTensor op,
    ``detach`` included) gives the *wrapper* that offset too, and a wrapper with a
    non-zero offset has a non-zero ``data_ptr()``, which sends ``torch.save`` down
    the plain-tensor path, where it reads the wrapper's (absent) storage: "invalid
    python storage". The state dict therefore carries wrappers built at offset 0
    around the same local view: ``torch.save`` then pickles the DTensor as a
    subclass and its local tensor as a plain view (the flat shard's storage is
    written once, shared by every entry), ``load_state_dict`` and DCP read the
    entries as before, and nothing is copied.
    """
    out = torch.Tensor._make_wrapper_subclass(
        type(t),
        t.shape,
        strides=t.stride(),
        dtype=t.dtype,
        device=t.device,
        layout=t.layout,
        requires_grad=t.requires_grad,
    )
    out._spec = t._spec
    out._local_tensor = t._local_tensor
    return out


def picklable_shards_hook(
    module: nn.Module, state_dict: dict[str, object], prefix: str, local_metadata: object
) -> None:
    """State-dict post-hook of each unit: see [Note: picklable shards]."""
    for key, value in state_dict.items():
        if (
            key.startswith(prefix)
            and isinstance(value, DTensor)
            and not isinstance(value, nn.Parameter)  # keep_vars=True: the live parameter
            and value.storage_offset() != 0
        ):
            state_dict[key] = _offset_free(value)
