"""A torch FSDP2 training script in the shape of torch's published FSDP2 example.

Meta-device construction, ``fully_shard`` per block and at the root with a mixed
precision policy, ``to_empty`` + ``reset_parameters``, explicit forward and backward
prefetching, a few Adam steps with clipping, per-rank and DCP checkpoints, and a
resume from each. ``test_fsdp2_example.py`` runs this file as it is (torch's
``fully_shard``) and again with only its FSDP2 import line switched to cadence's
(`bodies_fsdp2_example.CADENCE_IMPORTS`); nothing else in it may change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = ["main"]


@dataclass
class ModelArgs:
    n_layers: int = 3
    vocab_size: int = 32
    max_seq_len: int = 8
    dim: int = 16
    n_heads: int = 4


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            w(x).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.wo(y.transpose(1, 2).reshape(b, t, d))
        return out

    def reset_parameters(self) -> None:
        for w in (self.wq, self.wk, self.wv, self.wo):
            w.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.w1 = nn.Linear(args.dim, 4 * args.dim)
        self.w2 = nn.Linear(4 * args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = x + self.attention(self.attention_norm(x))
        out: torch.Tensor = h + self.w2(F.gelu(self.w1(self.ffn_norm(h))))
        return out

    def reset_parameters(self) -> None:
        for m in (self.attention_norm, self.attention, self.ffn_norm, self.w1, self.w2):
            m.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        logits: torch.Tensor = self.output(self.norm(h))
        return logits.float()

    def reset_parameters(self) -> None:
        for m in (self.tok_embeddings, self.pos_embeddings, *self.layers, self.norm, self.output):
            m.reset_parameters()


ARGS = ModelArgs()


def set_modules_to_forward_prefetch(model: Transformer, num_to_prefetch: int) -> None:
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        following = layers[i + 1 : i + 1 + num_to_prefetch]
        if following:
            layer.set_modules_to_forward_prefetch(following)  # type: ignore[operator]


def set_modules_to_backward_prefetch(model: Transformer, num_to_prefetch: int) -> None:
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        preceding = layers[max(0, i - num_to_prefetch) : i][::-1]
        if preceding:
            layer.set_modules_to_backward_prefetch(preceding)  # type: ignore[operator]


def build_model() -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    fsdp_kwargs: dict[str, Any] = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    }
    for layer in model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    assert isinstance(model, FSDPModule) and all(isinstance(m, FSDPModule) for m in model.layers)
    set_modules_to_forward_prefetch(model, num_to_prefetch=2)
    set_modules_to_backward_prefetch(model, num_to_prefetch=2)
    return model


def train(model: Transformer, optim: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(1000 * seed + dist.get_rank())  # each rank its own data
    losses = []
    for _ in range(steps):
        model.unshard()  # type: ignore[operator]
        x = torch.randint(0, ARGS.vocab_size, (4, ARGS.max_seq_len), generator=g)
        loss = model(x).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def main(workdir: str) -> dict[str, list[float]]:
    rank = dist.get_rank()
    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = build_model()
    model.to_empty(device="cpu")
    model.reset_parameters()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = train(model, optim, steps=3, seed=0)

    torch.save(model.state_dict(), out / f"model.{rank}.pt")
    torch.save(optim.state_dict(), out / f"optim.{rank}.pt")
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out / "dcp"))

    # Resume from the per-rank files into a model still on meta (assign=True).
    resumed = build_model()
    resumed.load_state_dict(torch.load(out / f"model.{rank}.pt"), assign=True)
    resumed_optim = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    resumed_optim.load_state_dict(torch.load(out / f"optim.{rank}.pt"))

    # Resume from the distributed checkpoint into a materialized model.
    from_dcp = build_model()
    from_dcp.to_empty(device="cpu")
    from_dcp_optim = torch.optim.Adam(from_dcp.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(from_dcp, from_dcp_optim)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(out / "dcp"))
    set_state_dict(
        from_dcp, from_dcp_optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return {
        "losses": losses,
        "continued": train(model, optim, steps=2, seed=1),
        "resumed_per_rank": train(resumed, resumed_optim, steps=2, seed=1),
        "resumed_dcp": train(from_dcp, from_dcp_optim, steps=2, seed=1),
    }
