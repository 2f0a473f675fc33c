"""Policies and errors of `cadence.fully_shard` (frozen, validated dataclasses).

[Note: FSDP2 arguments]
``cadence.fully_shard`` takes torch FSDP2's ``fully_shard`` arguments, so a script
switches by changing the import. Each is honoured or refused, never ignored:

- ``mesh``: a 1-D (shard) or 2-D (replicate, shard; HSDP) DeviceMesh, resolved
  exactly as ``group=`` (one of the two).
- ``reshard_after_forward``: True / False / None honoured; an int (FSDP2: reshard
  to a smaller world) is refused.
- ``mp_policy``: cadence's `MixedPrecisionPolicy` or torch's, converted field by
  field (same meanings; see `to_mp_policy`).
- ``offload_policy``: torch's base ``OffloadPolicy()`` (no offload) accepted;
  ``CPUOffloadPolicy`` refused (see `check_offload_policy`).
- ``shard_placement_fn``: results ``None`` / ``Shard(0)`` accepted, others refused.
- ``ignored_params``: honoured (not sharded, gradients not reduced).
- ``dp_mesh_dims``: refused; pass the data-parallel submesh as ``mesh``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_map

from cadence.errors import CadenceTypeError, CadenceValueError
from cadence.fsdp._errors import FullyShardError
from cadence.fsdp._mp_rules import REDUCE_DEFAULTS_TO_ORIG_DTYPE, check_torch_policy_fields

__all__ = [
    "FullyShardError",
    "MixedPrecisionPolicy",
    "check_fully_shard_args",
    "check_offload_policy",
    "to_mp_policy",
]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes the all-gather, the compute, the reduction and the accumulation use.

    ``None`` everywhere means "the parameter's own dtype" (no mixed precision).
    """

    param_dtype: torch.dtype | None = None
    """Dtype of the unsharded parameters: the all-gather and the forward/backward compute."""

    reduce_dtype: torch.dtype | None = None
    """Dtype of the reduce-scatter (and HSDP all-reduce). Default: as the installed torch's
    FSDP2: the parameter's own dtype from torch 2.15, ``param_dtype`` before (see [Note:
    the default reduce dtype follows the installed torch] in ``_mp_rules.py``)."""

    output_dtype: torch.dtype | None = None
    """Cast floating outputs of the root module's forward to this dtype."""

    cast_forward_inputs: bool = True
    """Cast floating forward inputs of every unit to ``param_dtype``."""

    accumulate_dtype: torch.dtype | None = None
    """Where no-sync accumulation happens: one unsharded buffer per unit in this dtype.

    Default: the reduce dtype. Choosing ``param_dtype`` instead avoids keeping an fp32
    copy of every unsharded gradient at the cost of bf16 accumulation.
    ``memory_stats()["accumulated_grad_bytes"]`` reports what it costs.
    """

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype", "accumulate_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOATS:
                raise CadenceValueError(
                    f"MixedPrecisionPolicy.{name}={value} is not a floating dtype; "
                    f"use one of {', '.join(str(d) for d in _FLOATS)} or None"
                )

    def resolve(
        self, orig: torch.dtype, grad: torch.dtype | None = None
    ) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        """(param, reduce, accumulate) dtypes for parameters whose own dtype is ``orig``
        and whose ``grad_dtype`` is ``grad`` if the user set one."""
        param = self.param_dtype or orig
        # See [Note: the default reduce dtype follows the installed torch] in _mp_rules.py
        # and [Note: a parameter's grad_dtype] there.
        default_reduce = (grad or orig) if REDUCE_DEFAULTS_TO_ORIG_DTYPE else param
        reduce = self.reduce_dtype or default_reduce
        return param, reduce, self.accumulate_dtype or reduce

    def cast_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The forward inputs as a unit's forward sees them (``cast_forward_inputs``)."""
        dtype = self.param_dtype
        if not self.cast_forward_inputs or dtype is None:
            return args, kwargs

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                return x.to(dtype)
            return x

        cast_args: tuple[Any, ...]
        cast_kwargs: dict[str, Any]
        cast_args, cast_kwargs = tree_map(cast, (args, kwargs))
        return cast_args, cast_kwargs


def to_mp_policy(policy: Any) -> MixedPrecisionPolicy:
    """cadence's policy from ``None``, cadence's own, or torch FSDP2's `MixedPrecisionPolicy`.

    torch's fields mean the same here (an unset ``reduce_dtype`` follows the installed
    torch's rule; no-sync accumulation happens in the reduce dtype, as FSDP2), so the
    conversion copies them; cadence's extra ``accumulate_dtype`` keeps its default. A
    field torch added that cadence cannot honour (2.15's ``param_dtype_override_fn``) is
    refused by name when set, never dropped.
    """
    if policy is None:
        return MixedPrecisionPolicy()
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    if isinstance(policy, TorchPolicy):
        check_torch_policy_fields(policy)
        return MixedPrecisionPolicy(
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
        )
    raise CadenceTypeError(
        f"fully_shard: mp_policy={type(policy).__name__}; pass a "
        "cadence.MixedPrecisionPolicy or torch.distributed.fsdp.MixedPrecisionPolicy."
    )


def check_offload_policy(policy: Any) -> None:
    """Accept "no offload" (None or torch's base `OffloadPolicy`); refuse CPU offload.

    Offloading moves the shards and the optimizer step to the CPU; fully_shard keeps
    shards on the device. Ignoring the request would silently use device memory
    the caller planned to free, so it is refused.
    """
    if policy is None:
        return
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if isinstance(policy, CPUOffloadPolicy):
        raise FullyShardError(
            "fully_shard: offload_policy=CPUOffloadPolicy() is not supported: cadence keeps "
            "the shards and the optimizer state on the device. Fix: drop offload_policy "
            "(or use torch.distributed.fsdp.fully_shard for CPU offload)."
        )
    if type(policy) is not OffloadPolicy:
        raise CadenceTypeError(
            f"fully_shard: offload_policy={type(policy).__name__}; only "
            "torch.distributed.fsdp.OffloadPolicy() (no offload) is accepted."
        )


def check_fully_shard_args(
    *,
    mesh: Any,
    group: Any,
    reshard_after_forward: Any,
    dp_mesh_dims: Any,
    offload_policy: Any,
) -> None:
    """fully_shard's refusals ([Note: FSDP2 arguments]), first: the module stays untouched."""
    if mesh is not None and group is not None:
        raise CadenceValueError(
            "fully_shard got both mesh= and group=; they name the same thing (the data-"
            "parallel group). Pass one."
        )
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise CadenceTypeError(
            f"fully_shard: mesh= takes a torch DeviceMesh, got {type(mesh).__name__}; pass "
            "other group forms as group=."
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise FullyShardError(
            f"fully_shard: reshard_after_forward={reshard_after_forward!r}; an int (FSDP2: "
            "reshard to a smaller world after forward) is not supported. Pass True, False "
            "or None."
        )
    if dp_mesh_dims is not None:
        raise FullyShardError(
            "fully_shard: dp_mesh_dims is not supported; pass the data-parallel submesh "
            '(e.g. mesh["dp_replicate", "dp_shard"]) as mesh= instead.'
        )
    check_offload_policy(offload_policy)
