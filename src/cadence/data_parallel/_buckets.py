"""Bucket plan: which parameters share one flat all-reduce buffer.

[Note: buckets are packed in the order gradients arrive]
Parameters are walked in *reverse* registration order, the order their gradients
roughly arrive in backward, and packed greedily, never split; a bucket closes once
it reaches its cap. Caps are given in that launch order, the last one repeating; by
default the first bucket launched gets a small cap (1 MiB), so the first reduction
starts early. This is the layout torch DDP reduces with after its first iteration
(it rebuilds its buckets in the order the gradients became ready, first bucket
capped at 1 MiB). The leftover of the packing is then the *last* bucket, holding the
first-registered parameters, whose gradients arrive last: a small tail after
backward. Packed the other way (registration order, then reversed, as DDP's
*initial* layout), the leftover is a tiny first bucket and the last one merges the
first layers with a full bucket, all of whose bytes wait for the end of backward:
on a link where the wire sets the step, that tail cost 3-5 % of a step against DDP
(`cadence bench step --link`; docs/benchmarks.md).

Parameters whose reduction is *delayed* (DDP's ``delay_all_reduce_named_params``)
form one extra bucket after all the others, launched only at the end of backward.

[Note: sparse buckets]
A parameter whose gradient is sparse (the weight of an ``nn.Embedding`` or
``nn.EmbeddingBag`` built with ``sparse=True``, the rule torch DDP uses) gets a
bucket of its own, at its place in the order. Its buffer is no flat slice of
anything: at launch it *becomes* the (scaled) sparse gradient, gloo all-reduces it
in place (gathering every rank's indices and values), and the reduced tensor is
assigned as ``.grad``, as torch DDP does. It has no views, so
``gradient_as_bucket_view`` leaves it alone, as DDP's does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Bucket", "build_buckets", "empty_sparse_like", "views_into"]

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
    sparse: bool = False  # see [Note: sparse buckets]


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
    sparse: frozenset[int] = frozenset(),
) -> list[Bucket]:
    """Group ``named_params`` into buckets, returned in launch order (see [Note:
    buckets are packed in the order gradients arrive]).

    ``bucket_caps_mb[k]`` caps the k-th bucket launched; the last entry repeats.
    ``delayed``: parameter indices for the delayed bucket. ``sparse``: parameter
    indices whose gradients are sparse, one bucket each.
    """
    groups: list[list[int]] = []
    n_sparse = 0  # groups of one sparse parameter: the caps count dense buckets only
    caps = [c * _MB for c in bucket_caps_mb]
    # Buckets are per (dtype, device): one flat buffer needs one of each.
    # Open bucket per key.
    open_by_key: dict[tuple[torch.dtype, torch.device], _OpenBucket] = {}
    for i in reversed(range(len(named_params))):
        p = named_params[i][1]
        if i in delayed:
            continue
        if i in sparse:
            groups.append([i])  # alone, at its place; the open dense buckets stay open
            n_sparse += 1
            continue
        wire = reduce_dtype or p.dtype
        key = (wire, p.device)
        current = open_by_key.get(key)
        if current is None:
            current = _OpenBucket([], caps[min(len(groups) - n_sparse, len(caps) - 1)])
            groups.append(current.members)
            open_by_key[key] = current
        current.members.append(i)
        current.size += p.numel() * torch.empty(0, dtype=wire).element_size()
        if current.size >= current.cap:
            del open_by_key[key]
    # Within a bucket, registration order: the buffer's layout (and each view's
    # offset) reads as the module does.
    order = [sorted(members) for members in groups]
    if delayed:
        order.append(sorted(delayed))
    buckets = []
    for index, members in enumerate(order):
        params = [named_params[j][1] for j in members]
        wire = reduce_dtype or params[0].dtype
        if members[0] in sparse:
            buckets.append(_sparse_bucket(index, members[0], named_params, wire))
            continue
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


def _sparse_bucket(
    index: int, member: int, named_params: list[tuple[str, torch.nn.Parameter]], wire: torch.dtype
) -> Bucket:
    name, p = named_params[member]
    return Bucket(
        index=index,
        params=[p],
        param_indices=[member],
        names=[name],
        buffer=empty_sparse_like(p, wire),
        sparse=True,
    )


def empty_sparse_like(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A sparse gradient of ``p`` with no entries: what a rank without one contributes.

    Laid out as an embedding's gradient (one sparse dimension, rows of values), so
    gloo can sum it with the other ranks' gradients.
    """
    indices = torch.empty(1, 0, dtype=torch.long, device=p.device)
    values = torch.empty(0, *p.shape[1:], dtype=dtype, device=p.device)
    return torch.sparse_coo_tensor(indices, values, p.shape, check_invariants=True)


def views_into(buffer: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """One view of ``buffer`` per parameter, shaped like it, packed in order."""
    views = []
    offset = 0
    for p in params:
        views.append(buffer.narrow(0, offset, p.numel()).view_as(p))
        offset += p.numel()
    return views
