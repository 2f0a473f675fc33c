"""Which dtype gradients reduce in when ``reduce_dtype`` is unset: the installed torch's rule.

[Note: the default reduce dtype follows the installed torch]
torch 2.15 changed FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=None)``
(its docstring: ``versionchanged:: 2.15``). Up to 2.14, gradients reduced in
``param_dtype``; from 2.15 they follow the parameter's ``grad_dtype``, which, unset, is
the parameter's own dtype (fp32 for fp32 parameters). 2.15 also gives each unsharded
parameter ``grad_dtype = <reduce dtype>``, so autograd accumulates the gradients of a
parameter used several times in one backward (tied weights, two forwards) in that
dtype, not in ``param_dtype``.

``cadence.fully_shard`` takes FSDP2's arguments so that a script switches by changing
its import; it therefore follows whichever rule the installed torch follows, for torch's
policy and for cadence's own (whose fields mean the same). The rule is detected from
the feature itself (FSDP2's ``FSDPParam.unsharded_grad_dtype``, which carries the new
rule), not from the version string, so a nightly build is classified by what it does;
the version is the fallback should that private module move.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from cadence.fsdp._errors import FullyShardError

__all__ = [
    "REDUCE_DEFAULTS_TO_ORIG_DTYPE",
    "check_torch_policy_fields",
    "grad_dtype_override",
    "set_unsharded_grad_dtype",
    "unsharded_grad_dtype",
]


def _reduce_defaults_to_orig_dtype() -> bool:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:  # the private module moved: decide by the documented version
        major, minor = (int(part) for part in torch.__version__.split(".")[:2])
        return (major, minor) >= (2, 15)
    return hasattr(FSDPParam, "unsharded_grad_dtype")


REDUCE_DEFAULTS_TO_ORIG_DTYPE: bool = _reduce_defaults_to_orig_dtype()
"""True (torch >= 2.15): ``reduce_dtype=None`` reduces in the parameter's own dtype."""


def unsharded_grad_dtype(param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> torch.dtype:
    """The dtype autograd leaves in an unsharded parameter's ``.grad`` (see the Note)."""
    return reduce_dtype if REDUCE_DEFAULTS_TO_ORIG_DTYPE else param_dtype


def set_unsharded_grad_dtype(param: nn.Parameter, reduce_dtype: torch.dtype) -> None:
    """Make autograd accumulate ``param``'s gradient in ``reduce_dtype``, as FSDP2 2.15 does.

    Under the older rule FSDP2 leaves the gradient in the compute dtype (cast only for the
    reduce-scatter), so nothing is set. See [Note: the default reduce dtype follows the
    installed torch].
    """
    if REDUCE_DEFAULTS_TO_ORIG_DTYPE:
        param.grad_dtype = reduce_dtype


def _overridden(p: nn.Parameter) -> torch.dtype | None:
    if getattr(p, "_has_grad_dtype_override", True) is False:
        return None
    # torch 2.13 has no override flag: an explicit grad_dtype equal to the parameter's
    # dtype is the same as none there, and None accepts the dtype the unit gives.
    dtype = p.grad_dtype
    return None if dtype is None or dtype == p.dtype else dtype


def grad_dtype_override(named: list[tuple[str, nn.Parameter]], owner: str) -> torch.dtype | None:
    """The ``Parameter.grad_dtype`` a unit's sharded gradients keep, if the user set one.

    [Note: a parameter's grad_dtype]
    ``p.grad_dtype = torch.float32`` on a bf16 parameter asks autograd for fp32
    gradients (pure-bf16 training with fp32 gradients). FSDP2 2.15 honours it: the
    sharded parameter keeps the policy, its gradient is written in that dtype, and an
    unset ``reduce_dtype`` reduces in it. cadence does the same on every torch lane
    (torch before 2.15 dropped it): the unit's default reduce dtype follows it under
    the 2.15 rule (see [Note: the default reduce dtype follows the installed torch]),
    and the reduced shard is written in it. One unit writes one flat gradient, so its
    parameters must agree; parameters that differ are refused, naming them.
    """
    found = {name: d for name, p in named if p.requires_grad and (d := _overridden(p))}
    dtypes = set(found.values())
    if not dtypes:
        return None
    plain = sorted(name for name, p in named if p.requires_grad and name not in found)
    if len(dtypes) > 1 or plain:
        raise FullyShardError(
            f"fully_shard({owner}): the parameters' grad_dtype differ "
            f"({ {n: str(d) for n, d in sorted(found.items())} }, unset for {plain}); one "
            "unit writes its gradients in one dtype. Fix: set the same grad_dtype on every "
            "parameter of the unit, or shard the differing ones as a separate unit."
        )
    return dtypes.pop()


# The fields of torch's MixedPrecisionPolicy that `to_mp_policy` converts. Any other field
# (torch adds them: 2.15's ``param_dtype_override_fn``) is refused by name when it is set,
# never dropped: a silently ignored field would train in dtypes the caller did not choose.
CONVERTED_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")

_FIXES = {
    "param_dtype_override_fn": (
        "fully_shard all-gathers one flat buffer per unit in one dtype, so a per-parameter "
        "override cannot be honoured. Fix: drop it, and shard the parameters that must keep "
        "their own dtype as a separate unit (fully_shard(submodule, mp_policy="
        "MixedPrecisionPolicy()))"
    ),
}


def check_torch_policy_fields(policy: Any) -> None:
    """Refuse every field of torch's policy that cadence does not convert, if it is set."""
    for f in dataclasses.fields(policy):
        if f.name in CONVERTED_FIELDS:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = getattr(policy, f.name)
        if value is default or value == default:
            continue
        fix = _FIXES.get(f.name, "Fix: leave it at its default, or use torch's fully_shard")
        raise FullyShardError(
            f"fully_shard: torch's MixedPrecisionPolicy({f.name}={value!r}) is not supported: "
            f"{fix}."
        )
