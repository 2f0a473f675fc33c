"""A sparse embedding's gradient built from its lookups, without torch's forward.

[Note: a sparse table's gradient from its lookups]
`EmbeddingExchange` gets every rank's ids and output gradient and needs the table's
gradient for their concatenation. Asking autograd for it means running the lookup's
forward on the world's batch first, which reads a table row per id (32768 rows of 64
floats in `cadence bench step`'s recommender) only to throw the output away, and
then the backward. That work sits on the critical path after backward, where the
step waits for the exchange.

For ``sparse=True`` the gradient needs no forward: torch's backward
(``_embedding_bag_sparse_backward``, then ``embedding_sparse_backward``) makes one
row per id, the output's gradient of the id's bag (an Embedding: of the id itself),
times the reciprocal of the bag's size for a mean (the ids that are not
``padding_idx``) and times the id's weight where per-sample weights are given, drops
``padding_idx``'s ids, and returns the rows, uncoalesced, at the ids. `lookup_grad`
does those operations with the same operands, so every value has the same bits
(tested against torch's own backward in every configuration the exchange accepts).
It scales a mean's rows before selecting them, one row per bag rather than per id,
which leaves each product unchanged. For the recommender case's 32768 lookups of
width 64 that is 0.35 ms on one thread, against 1.6-2.4 ms for the forward and
backward (docs/benchmarks.md has the step on the link).

A dense table (``sparse=False``) keeps torch's path: its backward sums each row's
lookups in its own order into a dense gradient, which a hand-built sum would not
reproduce bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["lookup_grad"]


def lookup_grad(
    module: nn.Embedding | nn.EmbeddingBag,
    ids: torch.Tensor,
    offsets: torch.Tensor | None,
    weights: torch.Tensor | None,
    grad: torch.Tensor,
) -> torch.Tensor:
    """The sparse gradient torch's backward gives the ``sparse=True`` ``module``'s
    weight for these lookups and this output gradient.

    ``ids`` are 1-D; ``offsets`` the bag starts without the last offset (None for an
    Embedding, one output row per id); ``weights`` the per-sample weights (a sum's);
    ``grad`` the output's gradient, a row per bag (per id), in the weight's dtype.
    """
    assert module.sparse, "a dense table's gradient is torch's backward's"
    if offsets is None:
        rows = grad
    else:
        assert isinstance(module, nn.EmbeddingBag)  # only a bag has offsets
        n_bags = offsets.numel()
        lengths = torch.diff(offsets, append=offsets.new_tensor([ids.numel()]))
        bag_of = torch.repeat_interleave(torch.arange(n_bags, device=ids.device), lengths)
        if module.mode == "mean":
            sizes = lengths
            if module.padding_idx is not None:  # a mean's size counts no padding id
                padded = (ids == module.padding_idx).to(lengths.dtype)
                sizes = lengths - torch.zeros_like(lengths).index_add_(0, bag_of, padded)
            # Per bag, then selected: the same product for every id of the bag.
            grad = grad * (1 / sizes.to(grad.dtype)).unsqueeze(1)
        rows = grad.index_select(0, bag_of)
        if weights is not None:  # torch allows them with mode="sum" only
            rows.mul_(weights.to(rows.dtype).unsqueeze(1))
    ids = ids.long()
    if module.padding_idx is not None:
        keep = ids != module.padding_idx
        ids, rows = ids[keep], rows[keep]
    size = (module.num_embeddings, rows.shape[-1])
    return torch.sparse_coo_tensor(ids.unsqueeze(0), rows, size, check_invariants=False)
