"""``--clip-grad-norm``: clip by the global gradient norm, under every layout.

[Note: the global gradient norm]
Clipping must scale every gradient by the same factor, computed from the norm of the
whole model's gradient: the norm a single process training the whole model on the
whole batch would compute. Where each rank's gradients live decides which groups
hold the pieces of that norm:

- DataParallel (and a pipeline without replicas): after the reduction every replica
  holds the whole averaged gradient of what it trains, so a replica's local norm is
  already the global one over the data-parallel ranks: no reduction over ``dp``;
- fully_shard: each gradient is a DTensor ``Shard(0)`` whose local tensor holds this
  rank's rows only (padding excluded), so the squares are summed over the shard
  group (``dp_shard``). Under HSDP the replicas hold equal shards: the sum runs over
  the shard group only, never over ``dp_replicate`` (that would count each shard once
  per replica);
- a pipeline: each rank holds some stages, so the stage sums are added over the
  ``pp`` group last (after the shard group, for fully_shard stages).

So: ``total = sqrt(sum over pp of sum over dp_shard of the local sum of squares)``.
The sum runs over this module's own gradients, in fp32, and costs one one-element
all-reduce per group per step. torch's ``clip_grad_norm_`` on the DTensor gradients
would reduce over their mesh alone (not over ``pp``), and in one more collective per
mesh dimension; this computes the same norm for every layout in one place. The
scaling then matches torch's: each gradient is multiplied by
``min(1, max_norm / (total + 1e-6))``, so gradients under the bound are unchanged
(multiplied by exactly 1), and a non-finite norm makes non-finite gradients, as in
torch with ``error_if_nonfinite=False``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from cadence.comm import Comm, EventLog
from cadence.topology import ParallelGroups
from cadence.train.config import Layout

__all__ = ["GradClipper", "local_sum_of_squares"]

# torch.nn.utils.clip_grad_norm_'s guard against a zero norm.
_EPS = 1e-6


def local_sum_of_squares(params: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of this rank's part of ``params``' gradients, in fp32: a
    DTensor gradient contributes its local shard."""
    total = torch.zeros((), dtype=torch.float32)
    for p in params:
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        total = total.to(local.device) + local.detach().float().pow(2).sum()
    return total


class GradClipper:
    """Clips the gradients of ``params`` (this rank's optimizer's) to a global norm of
    at most ``max_norm``. See [Note: the global gradient norm].

    Collective: every rank calls it once per step, after the gradients are reduced and
    before the optimizer step.
    """

    def __init__(
        self, params: list[torch.Tensor], max_norm: float, layout: Layout, groups: ParallelGroups
    ) -> None:
        self.params = params
        self.max_norm = max_norm
        # Its own log, as the loss reducer's: the wrappers' log counts gradient
        # reductions only, but a timeout report names these collectives too.
        self.log = EventLog(capacity=8)
        self.comms: list[Comm] = []
        shard = layout.dp // layout.dp_replicate
        if layout.wrapper == "fully_shard" and shard > 1:
            self.comms.append(Comm(groups.dp_shard, name="clip-dp-shard", event_log=self.log))
        if layout.pp > 1:
            self.comms.append(Comm(groups.pp, name="clip-pp", event_log=self.log))

    def total_norm(self) -> torch.Tensor:
        """The global norm of the gradients (the same value on every rank)."""
        sq = local_sum_of_squares(self.params).reshape(1)
        for comm in self.comms:
            comm.all_reduce(sq, op="sum")
        return sq.sqrt().reshape(())

    def __call__(self) -> float:
        """Clip in place; returns the norm before clipping."""
        norm = self.total_norm()
        coef = torch.clamp(self.max_norm / (norm + _EPS), max=1.0)
        for p in self.params:
            g = p.grad
            if g is None:
                continue
            local = g.to_local() if isinstance(g, DTensor) else g
            local.mul_(coef.to(local.device, local.dtype))
        return float(norm)
