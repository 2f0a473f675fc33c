"""What ``fully_shard`` accepts as its module, checked before anything changes.

[Note: modules fully_shard refuses]
- A list or tuple of modules (FSDP2's ``fully_shard([a, b])``: one parameter group over
  several modules, used for a tied embedding and head or a ``[norm, output]`` pair).
  cadence's unit is one module (its class is swapped, its hooks drive one forward), so
  the list form is refused, naming the fix: shard their common parent, or each module
  separately. Without this check the list reached ``collect_params`` and failed with an
  AttributeError about ``list.modules``.
- ``nn.ModuleList`` / ``nn.ModuleDict`` without a ``forward`` of their own: a unit
  gathers its parameters in its forward pre-hook, and a container's forward never runs,
  so its parameters would stay sharded when its children run. FSDP2 refuses these with
  ``ValueError`` (``_fsdp_init._check_module_type``'s condition), and so does cadence
  (`FullyShardValueError`).
- ``copy.deepcopy`` of a sharded module: the copy would share the unit's flat shard,
  runtime and hooks with the original (or fail on their storages). FSDP2 refuses it
  ("FSDP does not support deepcopy"); cadence refuses it with the state-dict fix.
- A non-contiguous parameter (a ``channels_last`` convolution's weight): a unit keeps
  each parameter as rows of one flat buffer, so it would come back contiguous, in a
  memory format the user did not choose, and its gradient too. FSDP2 refuses it with
  ``NotImplementedError``; cadence raises `FullyShardUnsupportedError`, which is one.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch import nn

from cadence.errors import CadenceTypeError
from cadence.fsdp._errors import (
    FullyShardError,
    FullyShardUnsupportedError,
    FullyShardValueError,
)

__all__ = ["check_contiguous", "check_module", "refuse_deepcopy"]


def check_module(module: Any) -> None:
    """Refuse what fully_shard cannot shard: [Note: modules fully_shard refuses]."""
    if isinstance(module, (list, tuple)):
        kinds = ", ".join(type(m).__name__ for m in module)
        raise FullyShardError(
            f"fully_shard got a {type(module).__name__} of modules ([{kinds}]): the list form "
            "(FSDP2's fully_shard([a, b]), one group over several modules) is not supported; "
            "a cadence unit is one module. Fix: apply fully_shard to their common parent "
            "(which then shards their parameters together, ties included), or to each "
            "module separately if they share no parameter."
        )
    if not isinstance(module, nn.Module):
        raise CadenceTypeError(f"fully_shard takes an nn.Module, got {type(module).__name__}.")
    if (
        isinstance(module, (nn.ModuleList, nn.ModuleDict))
        and type(module).forward is nn.Module.forward
    ):
        raise FullyShardValueError(
            f"fully_shard does not support containers that do not implement forward: "
            f"{type(module).__name__} never runs a forward, so its parameters would never be "
            "gathered. Fix: apply fully_shard to each module inside it, or to the module "
            "that holds the container and runs it."
        )


def refuse_deepcopy(module: nn.Module) -> NoReturn:
    """``copy.deepcopy`` of a sharded module: [Note: modules fully_shard refuses]."""
    raise FullyShardError(
        f"copy.deepcopy of the fully_shard module {type(module).__name__} is not supported "
        "(as FSDP2): the copy would share its shards, runtime and hooks. Fix: deepcopy the "
        "model before fully_shard, or build a new model, fully_shard it, and load "
        "state_dict() (or full_state_dict() with load_full_state_dict()) into it."
    )


def _memory_format(p: torch.Tensor) -> str:
    if p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if p.dim() == 5 and p.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    return f"strides {tuple(p.stride())}"


def check_contiguous(named: list[tuple[str, torch.Tensor]], owner: str) -> None:
    """Refuse non-contiguous parameters: [Note: modules fully_shard refuses]."""
    for fqn, p in named:
        if not p.is_meta and not p.is_contiguous():
            raise FullyShardUnsupportedError(
                f"parameter {fqn!r} of {owner} is not contiguous ({_memory_format(p)}): "
                "fully_shard keeps parameters as rows of a flat buffer and would hand it "
                "back in contiguous_format, and FSDP2 refuses it too. Fix: keep parameters "
                "contiguous (module.to(memory_format=torch.contiguous_format) before "
                "fully_shard) and pass channels_last activations instead, which the "
                "convolution follows."
            )
