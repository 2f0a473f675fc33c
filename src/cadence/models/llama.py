"""A small Llama-style decoder: RoPE, RMSNorm, SwiGLU, grouped-query attention.

``cadence train --model llama`` trains it; ``--model-config`` (``[train.model_config]``)
gives `LlamaConfig`'s fields. It declares the block protocol (`cadence.models.protocol`):
its ``layers`` are the fully_shard units and it is cut into pipeline stages by its
parts ``embed -> layers -> norm -> head``. The rotary tables are computed in each
block's forward (no buffers), so a block is a stage on its own and a model built on
the meta device needs nothing re-initialised.

Shape legend: B batch, T sequence, D width, H query heads, K key/value heads,
E head width (D / H), F the MLP's hidden width, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cadence.errors import CadenceValueError
from cadence.models.protocol import split_by_parts

__all__ = ["Attention", "Llama", "LlamaBlock", "LlamaConfig", "RMSNorm", "SwiGLU"]


@dataclass(frozen=True)
class LlamaConfig:
    """The Llama's shape (the keys of ``--model llama --model-config``)."""

    vocab_size: int = 64
    seq_len: int = 32
    """The longest sequence trained on (the rotary tables are computed for any length)."""
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    """Key/value heads, shared by ``n_heads / n_kv_heads`` query heads each (GQA);
    equal to ``n_heads`` is multi-head attention."""
    ffn_multiple: int = 32
    """The MLP's hidden width is 8/3 x dim rounded up to a multiple of this."""
    ffn_dim: int = 0
    """The MLP's hidden width itself; 0 derives it from ``ffn_multiple``."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    """The output head reuses the token embedding (not with pipelines)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "dim", "n_layers", "n_heads", "n_kv_heads"):
            if getattr(self, name) < 1:
                raise CadenceValueError(f"LlamaConfig.{name} must be >= 1")
        if self.ffn_multiple < 1 or self.ffn_dim < 0:
            raise CadenceValueError("LlamaConfig.ffn_multiple must be >= 1 and ffn_dim >= 0")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise CadenceValueError(
                f"LlamaConfig.dim {self.dim} must be n_heads {self.n_heads} x an even head width"
            )
        if self.n_heads % self.n_kv_heads:
            raise CadenceValueError(
                f"LlamaConfig.n_kv_heads {self.n_kv_heads} must divide n_heads {self.n_heads}"
            )

    @property
    def hidden(self) -> int:
        """The MLP's hidden width F."""
        m = self.ffn_multiple
        return self.ffn_dim or m * math.ceil(8 * self.dim / 3 / m)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x = x_BTD.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.type_as(x_BTD) * self.weight


def rotary(t: int, e: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables (T, E) of rotary position embeddings, half-rotation form."""
    inv_freq = 1.0 / theta ** (torch.arange(0, e, 2, device=device, dtype=torch.float32) / e)
    angles_TE = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv_freq)
    angles_TE = torch.cat((angles_TE, angles_TE), dim=-1)
    return angles_TE.cos(), angles_TE.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary positions on q and k."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.h, self.k, self.e = cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads
        self.theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, self.h * self.e, bias=False)
        self.wk = nn.Linear(cfg.dim, self.k * self.e, bias=False)
        self.wv = nn.Linear(cfg.dim, self.k * self.e, bias=False)
        self.wo = nn.Linear(self.h * self.e, cfg.dim, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        q_BHTE = self.wq(x_BTD).view(b, t, self.h, self.e).transpose(1, 2)
        k_BKTE = self.wk(x_BTD).view(b, t, self.k, self.e).transpose(1, 2)
        v_BKTE = self.wv(x_BTD).view(b, t, self.k, self.e).transpose(1, 2)
        cos, sin = rotary(t, self.e, self.theta, x_BTD.device)
        q_BHTE, k_BKTE = _rotate(q_BHTE, cos, sin), _rotate(k_BKTE, cos, sin)
        # Each key/value head serves n_heads / n_kv_heads consecutive query heads.
        group = self.h // self.k
        k_BHTE = k_BKTE.repeat_interleave(group, dim=1)
        v_BHTE = v_BKTE.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q_BHTE, k_BHTE, v_BHTE, is_causal=True)
        out: torch.Tensor = self.wo(y.transpose(1, 2).reshape(b, t, self.h * self.e))
        return out


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)  # down

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x_BTD)) * self.w3(x_BTD))
        return out


class LlamaBlock(nn.Module):
    """Pre-norm attention + SwiGLU MLP, each with its residual."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD))
        out: torch.Tensor = x_BTD + self.mlp(self.mlp_norm(x_BTD))
        return out


class Llama(nn.Module):
    """Embedding -> blocks -> RMSNorm -> head. ``forward`` returns logits (B, T, V).

    ``Llama(cfg)`` or ``Llama(**fields)`` (what ``cadence train --model llama`` calls
    with ``--model-config``'s keys)."""

    cadence_blocks = "layers"
    cadence_stage_parts = ("embed", "layers", "norm", "head")

    def __init__(self, cfg: LlamaConfig | None = None, **fields: Any) -> None:
        super().__init__()
        if cfg is not None and fields:
            raise TypeError("Llama takes a LlamaConfig or its fields as keywords, not both")
        self.cfg = cfg or LlamaConfig(**fields)
        c = self.cfg
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.head = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.embed(idx_BT)
        for block in self.layers:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits

    def split_stages(self, num_stages: int) -> list[nn.Module]:
        """``num_stages`` sequential chunks (see `split_by_parts`); refused when tied."""
        return split_by_parts(self, num_stages)
