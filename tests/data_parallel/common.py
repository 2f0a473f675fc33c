"""Models, batches and helpers shared by the DataParallel rank bodies."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

WIDTH = 16
PER_RANK = 4


def make_mlp(seed: int = 0, depth: int = 4, width: int = WIDTH) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def global_batch(step: int, world: int, n: int = PER_RANK) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * n, WIDTH, generator=g)
    y = torch.randn(world * n, 1, generator=g)
    return x, y


def local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def strip(d: dict[str, Any]) -> dict[str, Any]:
    """Parameter names without the wrapper's ``module.`` prefix."""
    return {k.removeprefix("module."): v for k, v in d.items()}


class TwoHeads(nn.Module):
    """``b`` is never used: a globally unused parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(WIDTH, 1)
        self.b = nn.Linear(WIDTH, 1)

        self.use_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) if self.use_b else self.a(x)


class RankDependent(nn.Module):
    """``b`` is used on rank 0 only: DDP averages including rank 1's zero."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(WIDTH, 1)
        self.b = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 0:
            return self.a(x) + self.b(x)
        return self.a(x)
