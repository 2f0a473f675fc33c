"""Sharded parameters created on meta, or replaced after sharding, seated in the flat shard.

[Note: meta-device init]
``fully_shard`` accepts a module on the meta device, as FSDP2 does, so a model too
big for one rank is never materialized whole: the unit's flat shard is then a meta
tensor and its sharded parameters are meta DTensors with the spec they would have
on a real device (same placements, same local rows). ``model.to_empty(device=...)``
materializes them through the re-seating below (each rank allocates only its
shard) and ``reset_parameters()`` / an ``init_weights()`` run on the sharded
DTensors. Nothing in cadence draws random numbers: DTensor's random ops do, on the
same specs as FSDP2's, so the values are FSDP2's. On CUDA that is its RNG tracker
(each shard gets the offsets of the full tensor); on CPU DTensor has no tracker and
each rank draws its local rows from its own generator (checked with gloo at world 2
on torch 2.13 and 2.15: every rank's shard starts with the same values). A forward,
an all-gather or ``full_state_dict()`` before the parameters are materialized
raises, naming ``to_empty``.

[Note: parameters replaced after sharding]
A unit's sharded parameters are DTensors whose local tensors are views of its flat
shard (see [Note: cadence FSDP tensors]): optimizers update them in place and the
all-gather reads the flat shard. Several nn.Module methods cut that link without
cadence taking part:

- ``nn.Module._apply`` (``to``, ``to_empty``, ``cuda``/``cpu``, ``float``/``half``/
  ``bfloat16``/``double``, ``type``) swaps a DTensor parameter's contents for a
  converted copy (``torch.utils.swap_tensors``: the same object with a new local
  tensor), on the fully_shard module or on any submodule inside a unit;
- ``load_state_dict(assign=True)`` and ``module.weight = nn.Parameter(...)`` register
  new objects.

Left alone, optimizer steps and initialisation would land in tensors the all-gather
never reads: training would go on from stale values with no error. So before
anything reads a flat shard (an all-gather, a state dict, the end of one of those
methods on a fully_shard module), the unit compares each registered object and its
local tensor with what it seated (`replaced`, two identity checks per parameter).
On a change it copies the new local values into the flat shard (a new one when the
dtype, the device or meta-ness changed) and points the registered object's local
tensor at its slice again (`plan_reseat`, `seat`): FSDP2's ``reset_sharded_param``,
which FSDP2 runs only at lazy init and in a unit's own ``_apply`` (so there a
submodule's ``_apply`` after the first forward is lost without a word). The
registered object is kept: after ``_apply`` it is the optimizer's; after
``assign=True`` torch already asks for a new optimizer. A plain tensor of the full
shape (a full checkpoint loaded with ``assign=True``) is sharded: this rank's rows
are copied. Anything else (another shape, other placements, a device the shard
group cannot use, mixed dtypes, meta and real parameters in one unit) raises
`FullyShardError` naming the parameter, the method and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from cadence.fsdp._errors import FullyShardError
from cadence.fsdp._param import ParamInfo, make_sharded_param

__all__ = [
    "Reseat",
    "check_meta_consistent",
    "check_param_devices",
    "plan_reseat",
    "replaced",
    "seat",
]


def check_meta_consistent(names_on_meta: list[str], names_real: list[str], owner: str) -> None:
    """One unit's parameters are all on meta or none: they share one flat shard."""
    if names_on_meta and names_real:
        raise FullyShardError(
            f"fully_shard({owner}): parameters {names_on_meta[:3]} are on the meta device but "
            f"{names_real[:3]} are not; one unit keeps one flat shard, on one device. Fix: "
            "create the whole module on meta (with torch.device('meta'): ...) or materialize "
            "it (to_empty) before fully_shard."
        )


def check_param_devices(params: list[ParamInfo], device: torch.device, owner: str) -> None:
    """Every parameter on meta or on the shard group's device type, before any is sharded."""
    on_meta: list[str] = []
    real: list[str] = []
    for info in params:
        reg_module, reg_name = info.registrations[0]
        p = reg_module._parameters[reg_name]
        assert p is not None
        if p.is_meta:  # see [Note: meta-device init]
            on_meta.append(info.fqn)
            continue
        real.append(info.fqn)
        if p.device.type != device.type:
            raise FullyShardError(
                f"parameter {info.fqn!r} is on {p.device} but the shard group uses {device}; "
                f"move the module to {device} (or build it on meta) before fully_shard."
            )
    check_meta_consistent(on_meta, real, owner)


def _registered(info: ParamInfo) -> torch.Tensor | None:
    module, name = info.registrations[0]
    return module._parameters.get(name)


def replaced(params: list[ParamInfo], *, sharded_registered: bool) -> bool:
    """Whether anything replaced a sharded parameter or its local tensor since `seat`."""
    for info in params:
        p = info.sharded
        if p is None or p._local_tensor is not info.local:  # type: ignore[attr-defined]  # a DTensor, typed as Parameter
            return True
        if sharded_registered:
            for module, name in info.registrations:
                if module._parameters.get(name) is not p:
                    return True
    return False


@dataclass
class Reseat:
    """What `seat` will do, validated before anything is touched."""

    sources: list[torch.Tensor]  # per parameter: this rank's rows, local shape
    objects: list[torch.Tensor]  # per parameter: the registered object (kept if it can be)
    dtype: torch.dtype
    meta: bool


def _same_values(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    if a is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_meta or b.is_meta:
        return a.is_meta and b.is_meta
    la = a._local_tensor if isinstance(a, DTensor) else a
    lb = b._local_tensor if isinstance(b, DTensor) else b
    return la.shape == lb.shape and bool(torch.equal(la, lb))


def plan_reseat(
    params: list[ParamInfo],
    *,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    device: torch.device,
    rank: int,
    sharded_registered: bool,
    name_of: Callable[[ParamInfo], str],
    what: str,
) -> Reseat:
    """Validate the parameters as they are now; see [Note: parameters replaced after sharding]."""
    sources: list[torch.Tensor] = []
    objects: list[torch.Tensor] = []
    for info in params:
        name = name_of(info)
        p = _registered(info) if sharded_registered else info.sharded
        if p is None:
            raise FullyShardError(
                f"{what}: parameter {name!r} was removed from its module, but fully_shard "
                "shards it. Fix: keep it registered; freeze it with requires_grad_(False)."
            )
        if sharded_registered:
            for module, attr in info.registrations[1:]:
                other = module._parameters.get(attr)
                if other is not p and not _same_values(other, p):
                    raise FullyShardError(
                        f"{what}: the tied parameter {name!r} now holds different tensors "
                        f"under its names (e.g. {attr!r}); fully_shard keeps one shard for it. "
                        "Fix: assign the same tensor to every name that shares it."
                    )
        if p.shape != info.shape:
            raise FullyShardError(
                f"{what}: parameter {name!r} now has shape {tuple(p.shape)}, but it was "
                f"sharded with shape {tuple(info.shape)}. Fix: give it its original shape "
                "(load values with load_state_dict or copy_), or build and shard a new model."
            )
        if isinstance(p, DTensor):
            if tuple(p.placements) != tuple(placements) or p.device_mesh != mesh:
                raise FullyShardError(
                    f"{what}: parameter {name!r} is a DTensor with placements {p.placements} "
                    f"on {p.device_mesh}, but fully_shard shards it as {placements} on "
                    f"{mesh}. Fix: redistribute it to those placements, or pass the full "
                    "tensor."
                )
            local = p._local_tensor
        else:
            start = min(rank * info.chunk_rows, info.shape[0])
            local = p.detach().narrow(0, start, info.local_rows)
        sources.append(local)
        objects.append(p)
    dtypes = {s.dtype for s in sources}
    if len(dtypes) > 1:
        raise FullyShardError(
            f"{what}: the parameters of one unit now have dtypes {sorted(map(str, dtypes))}; "
            "a unit keeps one flat shard of one dtype. Fix: convert the whole fully_shard "
            "module (e.g. model.to(dtype)), not a submodule of it."
        )
    on_meta = [name_of(i) for i, s in zip(params, sources) if s.is_meta]
    real = [name_of(i) for i, s in zip(params, sources) if not s.is_meta]
    if on_meta and real:
        raise FullyShardError(
            f"{what}: parameters {on_meta[:3]} are on the meta device and {real[:3]} are not; "
            "a unit keeps one flat shard, on one device. Fix: materialize the whole "
            "fully_shard module (to_empty on it), or load every one of its parameters."
        )
    for info, src, p in zip(params, sources, objects):
        if isinstance(p, DTensor) and not src.is_meta and src.device != device:
            raise FullyShardError(
                f"{what}: parameter {name_of(info)!r} is now on {src.device}, but its shard "
                f"group communicates on {device}. Fix: keep the model on {device} (build or "
                "materialize it there before fully_shard; use a process group of the device "
                "you want)."
            )
    dtype = dtypes.pop() if dtypes else torch.float32
    return Reseat(sources, objects, dtype, bool(on_meta))


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def seat(
    params: list[ParamInfo],
    plan: Reseat,
    flat: torch.Tensor,
    *,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    device: torch.device,
    sharded_registered: bool,
) -> torch.Tensor:
    """Copy the plan's values into the flat shard (a new one if needed) and re-seat the views.

    Returns the flat shard now in use. An unchanged dtype and device reuse the old
    one in place, so the views held elsewhere (an older optimizer's objects, state
    dicts already taken) keep seeing the live values.
    """
    reuse = not plan.meta and not flat.is_meta and flat.dtype == plan.dtype
    target = (
        flat
        if reuse
        else torch.zeros(
            flat.numel(), dtype=plan.dtype, device=torch.device("meta") if plan.meta else device
        )
    )
    with torch.no_grad():
        if not plan.meta:
            staged: list[torch.Tensor | None] = []
            for info, src in zip(params, plan.sources):
                dst = target.narrow(0, info.offset, info.local_numel)
                if src.numel() == 0 or (reuse and src.data_ptr() == dst.data_ptr()):
                    staged.append(None)  # already in place
                elif reuse and _shares_storage(src, target):
                    staged.append(src.clone())  # another slice of this shard: read it first
                else:
                    staged.append(src)
            for info, copy in zip(params, staged):
                if copy is not None:
                    target.narrow(0, info.offset, info.local_numel).copy_(copy.reshape(-1))
        for info, obj in zip(params, plan.objects):
            view = target.narrow(0, info.offset, info.local_numel).view(info.local_shape())
            sharded: nn.Parameter
            if (
                isinstance(obj, DTensor)
                and isinstance(obj, nn.Parameter)
                and obj.dtype == plan.dtype
                and obj.device == view.device
            ):
                obj._local_tensor = view
                sharded = obj
            else:
                sharded = make_sharded_param(info, target, mesh, placements)
                sharded.requires_grad_(obj.requires_grad)
            info.sharded = sharded
            info.local = sharded._local_tensor  # type: ignore[attr-defined]  # a DTensor, typed as Parameter
            if sharded_registered:
                info.register(sharded)
    return target
