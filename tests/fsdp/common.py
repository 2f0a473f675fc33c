"""Models and training loops shared by the fully_shard tests (importable by worker ranks)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from cadence.fsdp import fully_shard

__all__ = [
    "Block",
    "Blocks",
    "TinyTransformer",
    "apply_cadence",
    "apply_torch",
    "full_params",
    "make_blocks",
    "make_mlp",
    "reference_steps",
    "train_steps",
]


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Blocks(nn.Module):
    """3 x (Linear + ReLU) blocks and a head owned by the root: the FSDP2 count model."""

    def __init__(self, dim: int = 16, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def units(self) -> list[nn.Module]:
        return list(self.blocks)


def make_blocks() -> Blocks:
    torch.manual_seed(0)
    return Blocks()


def make_mlp() -> nn.Sequential:
    """Uneven dims (7, 5, 3 rows) so world 2/3/4 need padding; a frozen layer."""
    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Linear(8, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 1)
    )
    mlp[5].weight.requires_grad_(False)
    return mlp


class Attn(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Two blocks; the token embedding is tied to the output head (both in the root unit)."""

    def __init__(self, vocab: int = 11, dim: int = 12, n_layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(6, dim) * 0.1)
        self.layers = nn.ModuleList(Attn(dim, 2) for _ in range(n_layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x))

    def units(self) -> list[nn.Module]:
        return list(self.layers)


def apply_cadence(
    model: nn.Module, units: list[nn.Module], unit_raf: bool | None = None, **kwargs: object
) -> nn.Module:
    """fully_shard bottom-up; ``unit_raf`` is reshard_after_forward for the nested units."""
    for u in units:
        fully_shard(u, reshard_after_forward=unit_raf, **kwargs)  # type: ignore[arg-type]
    return fully_shard(model, **kwargs)  # type: ignore[arg-type]


def apply_torch(
    model: nn.Module, units: list[nn.Module], unit_raf: bool | None = None, **kwargs: object
) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for u in units:
        raf = True if unit_raf is None else unit_raf
        torch_fully_shard(u, mesh=mesh, reshard_after_forward=raf, **kwargs)  # type: ignore[arg-type]
    return torch_fully_shard(model, mesh=mesh, **kwargs)  # type: ignore[arg-type]


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[n] = t.detach().clone()
    return out


def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    if batch.dtype == torch.long:
        logits = model(batch[:, :-1])
        return nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
    return model(batch).float().pow(2).mean()


def make_batches(kind: str, steps: int, global_batch: int, seed: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "tokens":
        return [torch.randint(0, 11, (global_batch, 6), generator=g) for _ in range(steps)]
    dim = 8 if kind == "mlp" else 16
    return [torch.randn(global_batch, dim, generator=g) for _ in range(steps)]


def train_steps(
    model: nn.Module,
    batches: list[torch.Tensor],
    rank: int,
    world: int,
    *,
    microbatches: int = 1,
    before_micro: Callable[[int, bool], None] | None = None,
    after_backward: Callable[[], None] | None = None,
) -> list[float]:
    """SGD with momentum; each rank takes its slice of each global batch."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    losses = []
    for batch in batches:
        local = batch.chunk(world)[rank]
        micro = local.chunk(microbatches)
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            if before_micro is not None:
                before_micro(i, last)
            loss = loss_fn(model, mb) / len(micro)
            loss.backward()
            losses.append(float(loss.detach()))
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad()
    return losses


def reference_steps(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    train_steps(ref, batches, 0, 1)
    return {n: p.detach().clone() for n, p in ref.named_parameters()}
