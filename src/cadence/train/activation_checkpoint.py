"""``cadence train --ac``: activation checkpointing of the model's repeated blocks.

The blocks are the ones the model declares with the block protocol's
``cadence_blocks`` (`cadence.models.protocol`): TinyGPT's, Llama's, a ``transformers``
model's decoder layers (`cadence.models.hf`), a factory model's own.

- ``full``: each block's forward runs under ``torch.utils.checkpoint.checkpoint``
  (non-reentrant). The forward keeps only each block's input; backward recomputes the
  whole block before its gradients.
- ``selective``: the same, per operator (``create_selective_checkpoint_contexts``):
  the outputs of the matrix multiplications (`SAVED_OPS`: ``mm``, ``addmm``, ``bmm``)
  and of the fused scaled-dot-product attention kernels are kept from the forward;
  everything else in the block (norms, activations, residual adds, reshapes) is
  recomputed, without running the matmuls or attention again.

Checkpointing changes no number: the recompute runs the same operators on the same
inputs, so losses and parameters equal a run without ``--ac`` bit for bit on CPU
(`tests/train/test_activation_checkpoint.py`).

[Note: checkpointing patches the block's forward]
A wrapper module (torch's ``CheckpointWrapper``) would add a level to every parameter
name, so a checkpoint saved with ``--ac`` would not load without it, and a
``transformers`` model's blocks, which `cadence.models.hf` finds by their class name,
would be found no more. So the block stays where it is, with its class and its
parameter names; only its ``forward`` is replaced, on the instance, by a method that
calls the class's ``forward`` under ``checkpoint``. A method bound to the block (not a
closure over it) follows the block through ``copy.deepcopy``. The hooks a wrapper
installs later (``fully_shard``'s all-gather before a block's forward, its reshard
after) run around the checkpointed forward, and its pre-backward all-gather runs
when the block's output gradient arrives, before the recompute needs the parameters.
Without gradients (evaluation, sampling, a pipeline's shape inference) there is
nothing to save, and the block runs its plain forward.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn
from torch._ops import OpOverload
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from cadence.errors import CadenceValueError
from cadence.models.protocol import BLOCKS, model_blocks
from cadence.train._errors import TrainConfigError

__all__ = ["AC_ATTR", "SAVED_OPS", "checkpoint_blocks", "checkpoint_module"]

AC_ATTR = "_cadence_ac"
"""The instance attribute holding a checkpointed block's mode (``full``, ``selective``)."""

# The fused attention kernels of torch 2.13 to 2.15; a name a torch lacks is skipped.
# The composite math path of scaled_dot_product_attention decomposes into bmm, saved
# as a matmul.
_ATTENTION = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)


def _ops(names: tuple[str, ...]) -> list[OpOverload]:
    packets = (getattr(torch.ops.aten, n, None) for n in names)
    return [p.default for p in packets if p is not None]


SAVED_OPS: tuple[OpOverload, ...] = tuple(_ops(("mm", "addmm", "bmm", *_ATTENTION)))
"""The operators whose outputs ``--ac selective`` keeps (every other one is recomputed)."""


def _selective_contexts() -> tuple[Any, Any]:
    # A list of ops: MUST_SAVE for those, PREFER_RECOMPUTE for every other op. Fresh
    # contexts per call: they hold one forward's saved outputs.
    contexts: tuple[Any, Any] = create_selective_checkpoint_contexts(list(SAVED_OPS))
    return contexts


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A checkpointed block's ``forward``: its class's, under ``checkpoint``."""
    forward = functools.partial(type(self).forward, self)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if getattr(self, AC_ATTR) == "selective":
        return checkpoint(
            forward, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs
        )
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_module(module: nn.Module, mode: str) -> None:
    """Run ``module``'s forward under activation checkpointing (``full`` or
    ``selective``), in place; its class and parameter names stay as they were. See
    [Note: checkpointing patches the block's forward]."""
    if mode not in ("full", "selective"):
        raise CadenceValueError(f"activation checkpointing is full or selective, got {mode!r}")
    if "forward" in vars(module):
        raise CadenceValueError(
            f"{type(module).__name__}.forward is already replaced on this instance "
            "(checkpointed or precompiled already?): `del module.forward` first"
        )
    setattr(module, AC_ATTR, mode)
    module.forward = types.MethodType(_checkpointed_forward, module)


def checkpoint_blocks(model: nn.Module, mode: str) -> list[nn.Module]:
    """Checkpoint each block ``model`` declares (``--ac``); returns the blocks. Refuses
    (`TrainConfigError`) a model that declares none."""
    blocks = model_blocks(model)
    if blocks is None:
        raise TrainConfigError(
            f"--ac {mode} checkpoints each block, but {type(model).__name__} declares no "
            f"blocks: give it {BLOCKS} (see cadence.models.protocol), or drop --ac"
        )
    for block in blocks:
        checkpoint_module(block, mode)
    return blocks
