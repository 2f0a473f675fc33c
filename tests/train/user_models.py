"""Factories that ``cadence train --model tests.train.user_models:<name>`` imports, in
the tests' process and in the launched ranks (the repository root is their folder)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NOT_CALLABLE = 3


class Plain(nn.Module):
    """A model with no block protocol: trains under DataParallel only."""

    def __init__(self, vocab_size: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.embed(idx_BT))
        return out


def plain(**kwargs: Any) -> Plain:
    return Plain(**kwargs)


def not_a_module() -> object:
    return {"weights": 1}


def narrow(vocab_size: int = 8) -> Plain:
    return Plain(vocab_size=vocab_size)


def raw_hf_llama(**config: Any) -> nn.Module:
    """A transformers model as it is: its forward returns an object with ``.logits``."""
    import transformers

    model: nn.Module = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    return model
