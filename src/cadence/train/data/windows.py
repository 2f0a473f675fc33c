"""`TokenWindows`: each step's batch of ``--data`` windows, the same contract as
`cadence.models.data.MarkovTokens` (``batch(step, batch_size)`` is the step's global
batch on every rank; the loop slices it to the rank's replica).

[Note: the batch of a step is a function of (seed, step)]
Step N's batch is ``batch_size`` windows of ``seq_len + 1`` tokens at offsets drawn
by a generator seeded with ``seed x 1000003 + N`` (the Markov task's rule), uniform
over the training tokens. Nothing about the reader's position needs saving: a
resumed run asks for step N and gets step N's batch, bit for bit, whatever ran
before, and every rank draws the same offsets without a collective. Random windows
(with replacement) rather than a pass over the tokens in order: no epoch state, no
shuffle buffer, and windows start anywhere, not only at multiples of seq_len. The
price: a window can repeat before every token was seen (the expected coverage
after drawing as many tokens as the corpus holds is 1 - 1/e, about 63%).

Evaluation batch j is fixed, not drawn: windows ``j x batch_size`` onwards of the
held-out tokens cut into consecutive windows (each overlapping the next by the
one token that is the last target and the next first input), wrapping around when
there are fewer, so every evaluation scores the same tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from cadence.train.data.corpus import Corpus
from cadence.train.data.stream import TokenStream

__all__ = ["TokenWindows"]


class TokenWindows:
    """Deterministic (inputs, targets) batches from a `Corpus`."""

    def __init__(self, corpus: Corpus, seq_len: int, *, seed: int = 0) -> None:
        self.corpus = corpus
        self.seq_len = seq_len
        self.seed = seed
        self.vocab_size = corpus.vocab
        # Positions a training window may start at: it ends inside the training part.
        self.starts = len(corpus.train) - seq_len
        self.val_windows = (len(corpus.val) - 1) // seq_len

    def offsets(self, step: int, batch_size: int) -> torch.Tensor:
        """The training offsets of ``step``'s global batch (see the note above)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.starts, (batch_size,), generator=g)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: the same on every rank, so ranks can slice it."""
        return self._rows(self.corpus.train, self.offsets(step, batch_size).tolist())

    def val_offsets(self, index: int, batch_size: int) -> list[int]:
        """The held-out offsets of evaluation batch ``index``."""
        first = index * batch_size
        return [(first + r) % self.val_windows * self.seq_len for r in range(batch_size)]

    def val_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluation batch ``index`` (global, as `batch`)."""
        return self._rows(self.corpus.val, self.val_offsets(index, batch_size))

    def _rows(self, stream: TokenStream, offsets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.seq_len + 1
        rows = np.stack([stream.read(o, window) for o in offsets])
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1], tokens[:, 1:]
