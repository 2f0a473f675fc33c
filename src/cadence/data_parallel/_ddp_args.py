"""torch ``DistributedDataParallel``'s constructor arguments, resolved into DataParallel's plan.

[Note: DDP arguments]
``DataParallel`` accepts the whole constructor signature of torch's
``DistributedDataParallel`` (2.13), so ``DDP(model, ...)`` becomes
``cadence.DataParallel(model, ...)`` with nothing else changed. Each argument is
either honoured, or, where it means nothing for cadence, accepted and documented;
an argument is refused only where accepting it would change the result:

- ``device_ids`` / ``output_device``: honoured as DDP does. ``None`` for CPU modules;
  for a single-GPU module one entry naming the module's device, and forward moves
  the inputs there. Anything else raises, as DDP does.
- ``dim``: no effect for single-device modules, in DDP too (it was for the removed
  multi-device scatter); accepted.
- ``broadcast_buffers`` / ``forward_sync_buffers``: broadcast buffers from rank 0 at
  every forward; ``broadcast_buffers=False`` also skips the buffers at init (DDP's
  deprecated meaning), ``forward_sync_buffers`` does not.
- ``init_sync``: False skips the shape check and the init broadcast.
- ``process_group`` / ``device_mesh``: the same as ``group=`` (one of the three).
- ``bucket_cap_mb`` / ``bucket_cap_mb_list``: bucket caps, as DDP: left at ``None``
  the first bucket launched is capped at 1 MiB and the others at 25 MiB; an
  explicit cap applies to every bucket; a list gives per-bucket caps in launch
  order, its last entry repeating. cadence packs in reverse registration order,
  the layout DDP reduces with after its first step (it rebuilds its buckets in
  gradient-ready order); see [Note: buckets are packed in the order gradients
  arrive]. Where a model's gradients arrive in another order than the reverse of
  its registration, DDP's rebuilt boundaries can differ; the gradients are the
  same.
- ``find_unused_parameters``, ``gradient_as_bucket_view``, ``static_graph``: honoured.
- ``delay_all_reduce_named_params``: those parameters form one bucket of their own,
  reduced at the end of backward after every other bucket. ``param_to_hook_all_reduce``
  (DDP: launch that bucket when this parameter's gradient is ready) is accepted: the
  gradients are the same, the delayed bucket simply launches at the end.
- ``mixed_precision``: its ``reduce_dtype`` becomes the wire dtype. A
  ``param_dtype`` or ``buffer_dtype`` would make DDP run the forward in low
  precision, which DataParallel does not do, so they are refused (use
  ``torch.autocast``).
- ``skip_all_reduce_unused_params``: accepted with ``find_unused_parameters``; cadence
  still reduces whole buckets (the same gradients; DDP only saves their bytes).
- ``batched_grad_copy``: accepted; cadence always copies a bucket's gradients with
  one fused copy.
- ``check_reduction``: deprecated and ignored by DDP; accepted with DDP's warning.
- A module's ``_ddp_params_and_buffers_to_ignore`` (set by
  ``DDP._set_params_and_buffers_to_ignore_for_model``): those parameters are not
  reduced and those buffers are not broadcast, as DDP.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cadence._groups.dp_layout import DataParallelGroup
from cadence.data_parallel._errors import NothingToReduceError
from cadence.errors import CadenceTypeError, CadenceValueError

__all__ = ["DDPPlan", "resolve_ddp_args"]

_DEFAULT_CAP_MB = 25.0
_DEFAULT_FIRST_CAP_MB = 1.0
# Sentinel: "not passed", to tell DDP's default from an explicit value.
UNSET: Any = object()


@dataclass(frozen=True)
class DDPPlan:
    """What DataParallel does with the constructor arguments (see [Note: DDP arguments])."""

    group: DataParallelGroup
    input_device: torch.device | None  # forward moves inputs here (device_ids)
    device_ids: list[int] | None
    output_device: int | None
    bucket_caps_mb: tuple[float, ...]  # launch order; the last one repeats
    reduce_dtype: torch.dtype | None
    init_sync: bool
    init_sync_buffers: bool
    forward_sync_buffers: bool
    ignored: frozenset[str]  # parameter and buffer names DDP would ignore
    delayed: frozenset[str]  # parameter names reduced in the delayed bucket


def _device_index(device: Any, *, what: str) -> int:
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    dev = torch.device(device) if isinstance(device, str) else device
    if isinstance(dev, torch.device) and dev.index is not None:
        return dev.index
    raise CadenceValueError(
        f"DataParallel: {what}={device!r} does not name one device; pass an int or "
        "torch.device('cuda', i), as for torch DDP."
    )


def _resolve_devices(
    params: list[nn.Parameter], device_ids: Sequence[Any] | None, output_device: Any
) -> tuple[torch.device | None, list[int] | None, int | None]:
    devices = {p.device for p in params}
    if len({d.type for d in devices}) != 1:
        raise CadenceValueError(
            "DataParallel: module parameters must be on one type of device, got "
            f"{sorted(str(d) for d in devices)}."
        )
    if device_ids is not None and len(device_ids) > 1:
        raise CadenceValueError(
            f"DataParallel: device_ids={list(device_ids)} names several devices; one process "
            "drives one device. Pass device_ids=[local_rank] (or None)."
        )
    if not device_ids:
        if output_device is not None:
            raise CadenceValueError(
                "DataParallel: output_device needs device_ids (a single-GPU module), as in "
                "torch DDP; for a CPU module pass neither."
            )
        return None, None, None
    device = next(iter(devices))
    if device.type == "cpu" or len(devices) > 1:
        raise CadenceValueError(
            f"DataParallel: device_ids={list(device_ids)} only applies to a module on one "
            f"GPU, but its parameters are on {sorted(str(d) for d in devices)} (torch DDP "
            "refuses this too). Move the module first (model.to(local_rank)) or pass "
            "device_ids=None."
        )
    index = _device_index(device_ids[0], what="device_ids[0]")
    if index != device.index:
        raise CadenceValueError(
            f"DataParallel: device_ids=[{index}] but the module is on {device}. Move the "
            f"module to cuda:{index} first, or pass device_ids=[{device.index}]."
        )
    out = index if output_device is None else _device_index(output_device, what="output_device")
    return device, [index], out


def _resolve_group(
    group: DataParallelGroup,
    process_group: dist.ProcessGroup | None,
    device_mesh: DeviceMesh | None,
) -> DataParallelGroup:
    given = [
        name
        for name, v in (
            ("group", group),
            ("process_group", process_group),
            ("device_mesh", device_mesh),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise CadenceValueError(
            f"DataParallel got {' and '.join(given)}; they name the same thing (the group "
            "gradients are averaged over). Pass one."
        )
    if device_mesh is not None and getattr(device_mesh, "ndim", 1) != 1:
        raise CadenceValueError(
            f"DataParallel: device_mesh must be 1-D, as for torch DDP (got {device_mesh.ndim}-D)."
            " Pass the data-parallel submesh, or group= a 2-D mesh to flatten it."
        )
    if group is not None:
        return group
    return process_group if process_group is not None else device_mesh


def _resolve_caps(
    bucket_cap_mb: float | None,
    bucket_cap_mb_list: Sequence[float] | None,
    first_bucket_cap_mb: Any,
) -> tuple[float, ...]:
    if bucket_cap_mb_list:
        caps = tuple(float(c) for c in bucket_cap_mb_list)
        if first_bucket_cap_mb is not UNSET:
            raise CadenceValueError(
                "DataParallel: bucket_cap_mb_list already gives the first bucket's cap; "
                "drop first_bucket_cap_mb."
            )
    else:
        cap = _DEFAULT_CAP_MB if bucket_cap_mb is None else float(bucket_cap_mb)
        first: float | None
        if first_bucket_cap_mb is UNSET:
            # DDP: the small first bucket only when bucket_cap_mb is left at its default.
            first = _DEFAULT_FIRST_CAP_MB if bucket_cap_mb is None else None
        else:
            first = first_bucket_cap_mb
        caps = (cap,) if first is None else (min(float(first), cap), cap)
    if any(c <= 0 for c in caps):
        raise CadenceValueError(
            f"DataParallel: bucket caps must be positive, got {list(caps)} MiB (from "
            f"bucket_cap_mb={bucket_cap_mb}, bucket_cap_mb_list={bucket_cap_mb_list}, "
            f"first_bucket_cap_mb={None if first_bucket_cap_mb is UNSET else first_bucket_cap_mb})"
        )
    return caps


def _resolve_precision(
    mixed_precision: Any, reduce_dtype: torch.dtype | None
) -> torch.dtype | None:
    if mixed_precision is None:
        return reduce_dtype
    for name in ("param_dtype", "buffer_dtype"):
        if getattr(mixed_precision, name, None) is not None:
            raise CadenceValueError(
                f"DataParallel: mixed_precision.{name} would run the forward in "
                f"{getattr(mixed_precision, name)}; DataParallel keeps the module's dtypes, "
                "so the results would differ. Fix: use torch.autocast for the compute and "
                "pass mixed_precision with reduce_dtype only (or reduce_dtype=)."
            )
    mp_reduce = getattr(mixed_precision, "reduce_dtype", None)
    if reduce_dtype is not None and mp_reduce is not None and mp_reduce != reduce_dtype:
        raise CadenceValueError(
            f"DataParallel: reduce_dtype={reduce_dtype} and mixed_precision.reduce_dtype="
            f"{mp_reduce} disagree; pass one."
        )
    return reduce_dtype or mp_reduce


def resolve_ddp_args(
    module: nn.Module,
    *,
    group: DataParallelGroup,
    device_ids: Sequence[Any] | None,
    output_device: Any,
    dim: int,
    broadcast_buffers: bool | None,
    init_sync: bool,
    process_group: dist.ProcessGroup | None,
    bucket_cap_mb: float | None,
    bucket_cap_mb_list: Sequence[float] | None,
    first_bucket_cap_mb: Any,
    find_unused_parameters: bool,
    check_reduction: bool,
    delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None,
    param_to_hook_all_reduce: nn.Parameter | None,
    mixed_precision: Any,
    reduce_dtype: torch.dtype | None,
    device_mesh: DeviceMesh | None,
    skip_all_reduce_unused_params: bool,
    forward_sync_buffers: bool | None,
) -> DDPPlan:
    """Check every DDP argument against the module; see [Note: DDP arguments]."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise CadenceTypeError(f"DataParallel: dim must be an int, got {dim!r}")
    if check_reduction:
        warnings.warn(
            "The `check_reduction` argument of DataParallel (as of torch DDP) is deprecated "
            "and has no effect.",
            FutureWarning,
            stacklevel=3,
        )
    if skip_all_reduce_unused_params and not find_unused_parameters:
        raise CadenceValueError(
            "DataParallel: skip_all_reduce_unused_params=True needs find_unused_parameters=True "
            "(without it no parameter is known to be unused)."
        )
    ignored = frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()) or ())
    named = dict(module.named_parameters())
    delayed: set[str] = set()
    for name, param in delay_all_reduce_named_params or ():
        if named.get(name) is not param:
            raise CadenceValueError(
                f"DataParallel: delay_all_reduce_named_params names {name!r}, which is not "
                "that parameter of the module; pass module.named_parameters() entries."
            )
        delayed.add(name)
    if param_to_hook_all_reduce is not None and not delayed:
        raise CadenceValueError(
            "DataParallel: param_to_hook_all_reduce needs delay_all_reduce_named_params "
            "(it says when to reduce those)."
        )
    params = [p for n, p in named.items() if n not in ignored]
    if not any(p.requires_grad for p in params):
        # Before the device checks, which would name an empty device list instead.
        raise NothingToReduceError(
            f"DataParallel: {type(module).__name__} has no parameter that requires grad "
            f"({len(named)} parameter(s), {len(ignored)} ignored), so there is nothing to "
            "reduce; wrap a module with trainable parameters, or do not wrap this one "
            "(torch DDP refuses it too)."
        )
    input_device, ids, out_device = _resolve_devices(
        params or list(named.values()), device_ids, output_device
    )
    if forward_sync_buffers is not None:
        forward_sync, init_buffers = bool(forward_sync_buffers), True
    else:
        forward_sync = True if broadcast_buffers is None else bool(broadcast_buffers)
        init_buffers = forward_sync
    return DDPPlan(
        group=_resolve_group(group, process_group, device_mesh),
        input_device=input_device,
        device_ids=ids,
        output_device=out_device,
        bucket_caps_mb=_resolve_caps(bucket_cap_mb, bucket_cap_mb_list, first_bucket_cap_mb),
        reduce_dtype=_resolve_precision(mixed_precision, reduce_dtype),
        init_sync=bool(init_sync),
        init_sync_buffers=init_buffers,
        forward_sync_buffers=forward_sync,
        ignored=ignored,
        delayed=frozenset(delayed),
    )
