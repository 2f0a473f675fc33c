"""Bucket plan: which parameters share one flat all-reduce buffer.

Parameters are walked in registration order and packed greedily, never split;
a bucket closes once it reaches its cap. Caps are given in registration order,
the last one repeating; by default the first bucket gets a small cap. The list
is then reversed, because
gradients arrive roughly in reverse registration order; so the small bucket is
the *last* one reduced, which keeps the exposed tail of backward short (the same
reason torch DDP caps its first bucket at 1 MiB).

Parameters whose reduction is *delayed* (DDP's ``delay_all_reduce_named_params``)
form one extra bucket after all the others, launched only at the end of backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Bucket", "build_buckets", "views_into"]

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
    delayed: bool = False  # launched only when backward ends (never from a grad hook)


@dataclass
class _OpenBucket:
    """A bucket still taking members: its member indices, cap and bytes so far."""

    members: list[int]
    cap: float
    size: int = 0


def build_buckets(
    named_params: list[tuple[str, torch.nn.Parameter]],
    *,
    bucket_caps_mb: Sequence[float],
    reduce_dtype: torch.dtype | None,
    delayed: frozenset[int] = frozenset(),
) -> list[Bucket]:
    """Group ``named_params`` into buckets, returned in launch (reverse) order.

    ``bucket_caps_mb[k]`` caps the k-th bucket in registration order; the last
    entry repeats. ``delayed``: parameter indices for the delayed bucket.
    """
    groups: list[list[int]] = []
    caps = [c * _MB for c in bucket_caps_mb]
    # Buckets are per (dtype, device): one flat buffer needs one of each.
    # Open bucket per key.
    open_by_key: dict[tuple[torch.dtype, torch.device], _OpenBucket] = {}
    for i, (_, p) in enumerate(named_params):
        if i in delayed:
            continue
        wire = reduce_dtype or p.dtype
        key = (wire, p.device)
        current = open_by_key.get(key)
        if current is None:
            current = _OpenBucket([], caps[min(len(groups), len(caps) - 1)])
            groups.append(current.members)
            open_by_key[key] = current
        current.members.append(i)
        current.size += p.numel() * torch.empty(0, dtype=wire).element_size()
        if current.size >= current.cap:
            del open_by_key[key]
    order = list(reversed(groups))
    if delayed:
        order.append(sorted(delayed))
    buckets = []
    for index, members in enumerate(order):
        params = [named_params[j][1] for j in members]
        wire = reduce_dtype or params[0].dtype
        numel = sum(p.numel() for p in params)
        buffer = torch.zeros(numel, dtype=wire, device=params[0].device)
        views = views_into(buffer, params)
        buckets.append(
            Bucket(
                index=index,
                params=params,
                param_indices=list(members),
                names=[named_params[j][0] for j in members],
                buffer=buffer,
                views=views,
                delayed=bool(delayed) and index == len(order) - 1,
            )
        )
    return buckets


def views_into(buffer: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """One view of ``buffer`` per parameter, shaped like it, packed in order."""
    views = []
    offset = 0
    for p in params:
        views.append(buffer.narrow(0, offset, p.numel()).view_as(p))
        offset += p.numel()
    return views
