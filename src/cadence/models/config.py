"""The shape of the embedded TinyGPT, as a plain dataclass (no torch needed).

It lives apart from the model so that configuration (``cadence train``'s
`TrainConfig`, the CLI parser) can be built and validated where torch is not
imported yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from cadence.errors import CadenceValueError

__all__ = ["GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    """TinyGPT's shape: vocabulary, context length, width, heads, blocks, MLP ratio."""

    vocab_size: int = 64
    seq_len: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    mlp_ratio: int = 4
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise CadenceValueError(
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}"
            )
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise CadenceValueError(f"GPTConfig.{name} must be >= 1")
