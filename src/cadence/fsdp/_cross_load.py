"""Per-rank state dicts written under another DeviceMesh: adopted when the layout agrees.

[Note: per-rank state dicts across meshes]
A per-rank ``torch.save(model.state_dict())`` (or ``opt.state_dict()``) holds DTensors
that carry the mesh they were saved on, and DTensor refuses an op whose inputs sit
on two meshes that do not compare equal ("Cannot run aten.copy_.default on inputs
with different meshes"). torch compares meshes by value: the ranks, their layout,
the device type and the dimension names. So:

- cadence's mesh for ``group=None`` or a ``ProcessGroup`` has no dimension names, as
  the mesh FSDP2 builds when it is given none (``init_device_mesh(device, (world,))``),
  and ``mesh=`` is used as given: in those cases the two libraries' meshes are equal
  and a state dict, model or optimizer, loads both ways with no conversion at all.
- When the meshes differ only in what does not move data (the dimension names: say
  a torch mesh named ``("dp",)`` and cadence's ``ParallelGroups`` mesh named
  ``("dp_shard",)``), the sharded values are the same numbers on the same ranks:
  `adopt_dtensor` rewraps this rank's local shard on cadence's mesh (no copy, no
  collective). ``load_state_dict`` does this for the model's entries and a global
  optimizer step pre-hook (`install_optimizer_check`) hooks every optimizer's
  ``load_state_dict`` at its first step, and the hook does it for every DTensor
  state after each load (a load before the first step is checked at that step).
- When the layout differs (another world size, other ranks, other placements, other
  local rows) the local shard holds other elements: `adopt_dtensor` raises
  `FullyShardError` naming the entry, both layouts and the fix (a distributed
  checkpoint, which reshards), never a raw DTensor error or wrong values.

The opposite direction (cadence's file into torch's model) cannot be converted on
load, since torch's model runs no cadence code: it loads when the meshes are equal,
which is the default on both sides, or when torch's model is sharded on cadence's
mesh (``mesh=groups.dp_mesh``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from cadence.fsdp._errors import FullyShardError

__all__ = ["adopt_dtensor", "adopt_state_dict", "install_optimizer_check"]

# The optimizers whose loads are checked (their load post-hook is installed).
_WATCHED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_HOOK_INSTALLED = False


def _describe(t: DTensor) -> str:
    mesh = t.device_mesh
    names = f", dims {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
    return (
        f"ranks {mesh.mesh.tolist()}{names} on {mesh.device_type}, placements "
        f"{tuple(t.placements)}, local shape {tuple(t.to_local().shape)}"
    )


def _same_ranks(a: DeviceMesh, b: DeviceMesh) -> bool:
    return a.device_type == b.device_type and torch.equal(a.mesh, b.mesh)


def adopt_dtensor(value: DTensor, target: DTensor, what: str) -> DTensor:
    """``value`` on ``target``'s mesh when both shard the same way; else a clear error.

    ``what`` names the entry in the error. Equal meshes return ``value`` itself.
    """
    if value.device_mesh == target.device_mesh:
        return value
    local = value.to_local()
    if (
        _same_ranks(value.device_mesh, target.device_mesh)
        and tuple(value.placements) == tuple(target.placements)
        and value.shape == target.shape
        and local.shape == target.to_local().shape
    ):
        return DTensor.from_local(
            local,
            target.device_mesh,
            target.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    raise FullyShardError(
        f"{what} was saved sharded as [{_describe(value)}], but this model shards it as "
        f"[{_describe(target)}]: a per-rank state dict holds only this rank's shard, so it "
        "loads only into the same layout (the same world size, ranks and placements). "
        "Fix: save and load with torch.distributed.checkpoint (get_state_dict, dcp.save, "
        "dcp.load, set_state_dict), which reshards, or gather the model with "
        "full_state_dict() and load it with load_full_state_dict()."
    )


def adopt_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], what: str
) -> Mapping[str, Any]:
    """``state_dict`` with DTensor entries moved onto the module's meshes (see the Note).

    Returns ``state_dict`` itself when nothing needs moving.
    """
    current = nn.Module.state_dict(module, keep_vars=True)
    adopted: dict[str, Any] = {}
    for key, value in state_dict.items():
        target = current.get(key)
        if isinstance(value, DTensor) and isinstance(target, DTensor):
            moved = adopt_dtensor(value, target, f"{what}: entry {key!r}")
            if moved is not value:
                adopted[key] = moved
    if not adopted:
        return state_dict
    out: dict[str, Any] = {**state_dict, **adopted}
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out = _with_metadata(out, metadata)
    return out


class _StateDict(dict[str, Any]):
    """A plain dict that can carry ``_metadata`` (versions), as torch's OrderedDict does."""

    _metadata: Any


def _with_metadata(entries: dict[str, Any], metadata: Any) -> dict[str, Any]:
    out = _StateDict(entries)
    out._metadata = metadata
    return out


def install_optimizer_check() -> None:
    """Install the optimizer check (`_watch_optimizer`) once, at the first sharded parameter.

    It holds no reference to parameters: a weak reference would make
    ``torch.utils.swap_tensors`` (``to_empty`` on a meta model) refuse to swap them.
    """
    global _HOOK_INSTALLED
    if not _HOOK_INSTALLED:
        register_optimizer_step_pre_hook(_watch_optimizer)
        _HOOK_INSTALLED = True


def _watch_optimizer(opt: Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: at an optimizer's first step, check it and hook its loads.

    After that it returns at once; the optimizer's own load post-hook checks every
    later ``load_state_dict``.
    """
    if opt in _WATCHED:
        return
    _WATCHED[opt] = True
    opt.register_load_state_dict_post_hook(_adopt_optimizer_states)
    _adopt_optimizer_states(opt)  # a state dict loaded before the first step


def _adopt_optimizer_states(opt: Optimizer) -> None:
    """Loaded DTensor states onto their parameters' meshes, or a clear error.

    A state whose mesh equals its parameter's (always, unless a state dict saved on
    another mesh was loaded) is left alone, so this changes nothing else, for
    cadence's parameters and torch's alike.
    """
    for g, group in enumerate(opt.param_groups):
        for i, param in enumerate(group["params"]):
            param_state = opt.state.get(param)
            if not isinstance(param, DTensor) or not param_state:
                continue
            for key, value in list(param_state.items()):
                if isinstance(value, DTensor):
                    what = f"optimizer state {key!r} of parameter {i} of param group {g}"
                    param_state[key] = adopt_dtensor(value, param, what)
