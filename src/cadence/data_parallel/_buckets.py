"""Bucket plan: which parameters share one flat all-reduce buffer.

Parameters are walked in registration order and packed greedily, never split;
a bucket closes once it reaches its cap. The first bucket in registration order
gets the small ``first_bucket_cap_mb`` cap. The list is then reversed, because
gradients arrive roughly in reverse registration order; so the small bucket is
the *last* one reduced, which keeps the exposed tail of backward short (the same
reason torch DDP caps its first bucket at 1 MiB).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Bucket", "build_buckets"]

_MB = 1024 * 1024


@dataclass
class Bucket:
    """One flat communication buffer and the parameters whose grads it carries."""

    index: int
    params: list[torch.nn.Parameter]
    param_indices: list[int]  # positions in the wrapper's parameter list
    names: list[str]
    buffer: torch.Tensor  # 1-D, wire dtype
    views: list[torch.Tensor] = field(default_factory=list)  # per-param views into buffer


def build_buckets(
    named_params: list[tuple[str, torch.nn.Parameter]],
    *,
    bucket_cap_mb: float,
    first_bucket_cap_mb: float | None,
    reduce_dtype: torch.dtype | None,
) -> list[Bucket]:
    """Group ``named_params`` into buckets, returned in launch (reverse) order."""
    groups: list[list[int]] = []
    # The small cap never exceeds the regular one (a tiny bucket_cap_mb means tiny buckets).
    first = (
        bucket_cap_mb if first_bucket_cap_mb is None else min(first_bucket_cap_mb, bucket_cap_mb)
    )
    caps = [first * _MB, bucket_cap_mb * _MB]
    # Buckets are per (dtype, device): one flat buffer needs one of each.
    # Open bucket per key: [member indices, cap in bytes, bytes so far].
    open_by_key: dict[tuple[torch.dtype, torch.device], list] = {}
    for i, (_, p) in enumerate(named_params):
        wire = reduce_dtype or p.dtype
        key = (wire, p.device)
        current = open_by_key.get(key)
        if current is None:
            current = [[], caps[0] if not groups else caps[1], 0]
            groups.append(current[0])
            open_by_key[key] = current
        current[0].append(i)
        current[2] += p.numel() * torch.empty(0, dtype=wire).element_size()
        if current[2] >= current[1]:
            del open_by_key[key]
    buckets = []
    for index, members in enumerate(reversed(groups)):
        params = [named_params[j][1] for j in members]
        wire = reduce_dtype or params[0].dtype
        numel = sum(p.numel() for p in params)
        buffer = torch.zeros(numel, dtype=wire, device=params[0].device)
        views = []
        offset = 0
        for p in params:
            views.append(buffer.narrow(0, offset, p.numel()).view_as(p))
            offset += p.numel()
        buckets.append(
            Bucket(
                index=index,
                params=params,
                param_indices=list(members),
                names=[named_params[j][0] for j in members],
                buffer=buffer,
                views=views,
            )
        )
    return buckets
