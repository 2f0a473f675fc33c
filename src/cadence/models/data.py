"""A synthetic but learnable token stream: a fixed sparse Markov chain.

Each token has two likely successors, so a model that learns the chain reaches a
loss near ln 2 ~ 0.69 from ln V at the start: a clear, quick fall on CPU.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MarkovTokens"]


class MarkovTokens:
    """Deterministic batches of (inputs, targets) from a seeded sparse Markov chain."""

    def __init__(self, vocab_size: int = 64, seq_len: int = 32, *, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        g = torch.Generator().manual_seed(seed)
        # Two successors per token with probabilities 0.5 / 0.5 (plus a little noise).
        succ = torch.randint(0, vocab_size, (vocab_size, 2), generator=g)
        probs = torch.full((vocab_size, vocab_size), 0.02 / vocab_size)
        probs.scatter_add_(1, succ, torch.full((vocab_size, 2), 0.49))
        self.transition = probs / probs.sum(1, keepdim=True)
        self.seed = seed

    @property
    def entropy_floor(self) -> float:
        """The chain's conditional entropy: the best achievable mean loss (nats)."""
        p = self.transition
        return float(-(p * p.log()).sum(1).mean())

    @property
    def uniform_loss(self) -> float:
        return math.log(self.vocab_size)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: the same on every rank, so ranks can slice it."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=g)
        for t in range(1, self.seq_len + 1):
            tokens[:, t] = torch.multinomial(self.transition[tokens[:, t - 1]], 1, generator=g)[
                :, 0
            ]
        return tokens[:, :-1], tokens[:, 1:]
