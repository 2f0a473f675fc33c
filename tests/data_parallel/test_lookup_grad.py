"""`lookup_grad`: a sparse table's gradient built from its lookups has the bits of torch's
own backward (indices, values, and the table after an SGD step), in every
configuration `EmbeddingExchange` accepts; see [Note: a sparse table's gradient from
its lookups]."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from cadence.data_parallel._lookup_grad import lookup_grad

VOCAB, DIM = 30, 5

# (module kind, options, input layout, per-sample weights)
CASES: dict[str, tuple[str, dict[str, Any], str, bool]] = {
    "bag-mean-2d": ("bag", {"mode": "mean"}, "2d", False),
    "bag-mean-offsets-empty-bags": ("bag", {"mode": "mean"}, "offsets", False),
    "bag-mean-padding": ("bag", {"mode": "mean", "padding_idx": 1}, "offsets", False),
    "bag-sum-2d-padding": ("bag", {"mode": "sum", "padding_idx": 1}, "2d", False),
    "bag-sum-weights": ("bag", {"mode": "sum"}, "offsets", True),
    "bag-sum-weights-padding": ("bag", {"mode": "sum", "padding_idx": 1}, "offsets", True),
    "bag-mean-last-offset": ("bag", {"mode": "mean", "include_last_offset": True}, "last", False),
    "embedding": ("embedding", {}, "2d", False),
    "embedding-padding": ("embedding", {"padding_idx": 1}, "2d", False),
}  # fmt: skip


def _lookups(layout: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ids and offsets (with the last one for ``last``) that repeat ids, pad, and have
    empty bags and a bag of padding only."""
    if layout == "2d":
        ids = torch.randint(0, 8, (6, 4), generator=g)  # a small range: repeated ids
        ids[0, :2] = 1
        ids[2, :] = 1  # a bag of padding only
        return ids, None
    lengths = torch.randint(0, 6, (9,), generator=g)
    lengths[3] = 0
    ids = torch.randint(0, 8, (int(lengths.sum()),), generator=g)
    ids[: min(3, ids.numel())] = 1
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    if layout == "last":
        return ids, torch.cat([starts, lengths.sum().reshape(1)])
    return ids, starts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(CASES))
def test_lookup_grad_has_torchs_bits(name: str, dtype: torch.dtype) -> None:
    kind, options, layout, weighted = CASES[name]
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        cls = nn.Embedding if kind == "embedding" else nn.EmbeddingBag
        module = cls(VOCAB, DIM, sparse=True, **options).to(dtype)
        ids, offsets = _lookups(layout, g)
        weights = torch.rand(ids.numel(), generator=g, dtype=dtype) if weighted else None
        out = module(ids, offsets, per_sample_weights=weights) if kind == "bag" else module(ids)
        grad = torch.randn(out.shape, generator=g, dtype=dtype) / 3  # as the exchange divides
        (expected,) = torch.autograd.grad(out, module.weight, grad)

        # What the exchange hands over: 1-D ids, the bag starts without the last offset.
        starts = None
        if kind == "bag":
            starts = torch.arange(0, ids.numel(), ids.shape[-1]) if ids.dim() == 2 else offsets
            if options.get("include_last_offset"):
                assert starts is not None
                starts = starts[:-1]
        got = lookup_grad(module, ids.reshape(-1), starts, weights, grad.reshape(-1, DIM))

        assert got.is_sparse and not got.is_coalesced() and got.shape == expected.shape
        assert torch.equal(got._indices(), expected._indices()), (name, seed)
        assert torch.equal(got._values(), expected._values()), (name, seed)
        # ... so SGD steps the table to the same bits.
        tables = [module.weight.detach().clone() for _ in range(2)]
        tables[0].add_(got, alpha=-0.37)
        tables[1].add_(expected, alpha=-0.37)
        assert torch.equal(tables[0], tables[1])
