"""Microbatch split/merge and the loss-reduction policy.

[Note: loss scaling is applied once, to the loss]
torch pipelining divides *all* gradients by the number of microbatches after each
step's last backward (``scale_grads=True``). Gradients accumulated over two steps
without ``zero_grad`` are then divided twice (pytorch/torchtitan#1733). cadence
scales each microbatch's *loss* before its backward instead, so every step's
contribution is scaled exactly once, whatever was already in ``.grad``.
With ``loss_reduction="mean"`` (the default) the gradients equal those of
single-process training on the full batch with a mean loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from cadence.pipeline.runtime.errors import PipelineUsageError

__all__ = ["LossPolicy", "merge_microbatches", "split_microbatches"]


@dataclass(frozen=True)
class LossPolicy:
    """How per-microbatch losses combine into the step's loss.

    Attributes:
        reduction: ``"mean"`` — the step loss is the mean over microbatches, and
            each microbatch loss is divided by ``m`` before its backward (equal to
            one process on the full batch with a mean loss). ``"sum"`` — the step
            loss is the sum and no scaling is applied (the caller scales, if at all).
    """

    reduction: Literal["mean", "sum"] = "mean"

    def __post_init__(self) -> None:
        if self.reduction not in ("mean", "sum"):
            raise PipelineUsageError(
                f"loss_reduction={self.reduction!r}; use 'mean' (default) or 'sum'"
            )

    def scale(self, num_microbatches: int) -> float:
        return 1.0 / num_microbatches if self.reduction == "mean" else 1.0

    def combine(self, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        stacked = torch.stack([loss.detach() for loss in losses])
        return stacked.mean() if self.reduction == "mean" else stacked.sum()


def split_microbatches(args: Sequence[Any], num_microbatches: int) -> list[tuple[Any, ...]]:
    """Split every tensor in ``args`` along dim 0 into equal microbatches.

    Non-tensors are passed to every microbatch unchanged. Raises ``ValueError``
    (before any communication) if a tensor's batch does not divide evenly: unequal
    chunks would fail late, or silently, on the wire (see stage.py's note).
    """
    if num_microbatches < 1:
        raise PipelineUsageError(f"num_microbatches must be >= 1, got {num_microbatches}")
    chunks: list[list[Any]] = [[] for _ in range(num_microbatches)]
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if a.dim() == 0:
                raise PipelineUsageError(f"input {i} is a 0-d tensor; it has no batch dim to split")
            n = a.shape[0]
            if n % num_microbatches:
                raise PipelineUsageError(
                    f"input {i} has batch size {n}, which does not split into "
                    f"{num_microbatches} equal microbatches. Use a batch size that is a "
                    f"multiple of {num_microbatches} (e.g. {n - n % num_microbatches or num_microbatches}), "
                    "or change n_microbatches."
                )
            for c, part in zip(chunks, a.split(n // num_microbatches, dim=0)):
                c.append(part)
        else:
            for c in chunks:
                c.append(a)
    return [tuple(c) for c in chunks]


def merge_microbatches(outputs: Sequence[tuple[torch.Tensor, ...]]) -> Any:
    """Concatenate last-stage outputs along dim 0 (a tensor if the stage returns one)."""
    if not outputs:
        return None
    merged = tuple(torch.cat([o[i] for o in outputs], dim=0) for i in range(len(outputs[0])))
    return merged[0] if len(merged) == 1 else merged
