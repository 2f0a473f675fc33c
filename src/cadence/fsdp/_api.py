"""Policies and errors of `cadence.fully_shard` (frozen, validated dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.errors import CadenceRuntimeError, CadenceValueError

__all__ = ["FullyShardError", "MixedPrecisionPolicy"]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class FullyShardError(CadenceRuntimeError):
    """A misuse of a fully sharded module: the message names the cause and the fix.

    A `cadence.errors.CadenceError` and a ``RuntimeError``.
    """


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes the all-gather, the compute, the reduction and the accumulation use.

    ``None`` everywhere means "the parameter's own dtype" (no mixed precision).
    """

    param_dtype: torch.dtype | None = None
    """Dtype of the unsharded parameters: the all-gather and the forward/backward compute."""

    reduce_dtype: torch.dtype | None = None
    """Dtype of the reduce-scatter (and HSDP all-reduce). Default: ``param_dtype``."""

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

    def resolve(self, orig: torch.dtype) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        """(param, reduce, accumulate) dtypes for parameters whose own dtype is ``orig``."""
        param = self.param_dtype or orig
        reduce = self.reduce_dtype or param
        return param, reduce, self.accumulate_dtype or reduce
