"""A tiny GPT-style decoder: small enough for two CPU cores, real enough to train.

Shape legend: B batch, T sequence, D model width, H heads, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cadence.models.config import GPTConfig

__all__ = ["Block", "Embedding", "GPTConfig", "Head", "TinyGPT"]


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        t = idx_BT.shape[1]
        pos = torch.arange(t, device=idx_BT.device)
        # nn.Module.__call__ returns Any: the annotations say what these are.
        tok_BTD: torch.Tensor = self.tok(idx_BT)
        pos_TD: torch.Tensor = self.pos(pos)
        return tok_BTD + pos_TD[None]


class Block(nn.Module):
    """Pre-norm attention + MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        b, t, d = x_BTD.shape
        q, k, v = self.qkv(self.ln1(x_BTD)).split(d, dim=-1)
        # (B, H, T, D/H)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_BTD = x_BTD + self.proj(y.transpose(1, 2).reshape(b, t, d))
        mlp: torch.Tensor = self.out(F.gelu(self.fc(self.ln2(x_BTD))))
        return x_BTD + mlp


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm(self.ln(x_BTD))
        return logits


class TinyGPT(nn.Module):
    """Embedding -> blocks -> head. ``forward`` returns logits (B, T, V)."""

    cadence_blocks = "blocks"  # the fully_shard units (cadence.models.protocol)

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or GPTConfig()
        self.embed = Embedding(self.cfg)
        self.blocks = nn.ModuleList(Block(self.cfg) for _ in range(self.cfg.n_layers))
        self.head = Head(self.cfg)
        if self.cfg.tie_embeddings:
            self.head.lm.weight = self.embed.tok.weight

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx_BT)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(x)
        return logits

    @staticmethod
    def loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), targets_BT.reshape(-1))

    def split_stages(self, num_stages: int) -> list[nn.Sequential]:
        """Cut the model into ``num_stages`` sequential chunks for pipeline parallelism.

        Blocks are spread as evenly as possible; the embedding goes with the first
        chunk and the head with the last. The chunks share this model's parameters.
        """
        if self.cfg.tie_embeddings and num_stages > 1:
            raise ValueError(
                "tied embeddings cannot be split across pipeline stages; "
                "build the model with GPTConfig(tie_embeddings=False)"
            )
        n = len(self.blocks)
        if not 1 <= num_stages <= n:
            raise ValueError(f"num_stages={num_stages} must be between 1 and n_layers={n}")
        bounds = [round(i * n / num_stages) for i in range(num_stages + 1)]
        stages = []
        for s in range(num_stages):
            parts: list[nn.Module] = []
            if s == 0:
                parts.append(self.embed)
            parts.extend(self.blocks[bounds[s] : bounds[s + 1]])
            if s == num_stages - 1:
                parts.append(self.head)
            stages.append(nn.Sequential(*parts))
        return stages
