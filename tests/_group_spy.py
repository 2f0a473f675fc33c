"""Count the process groups a build creates, by either of torch's two ways.

Where the backend can split (`cadence.topology.can_split`), `Topology.build` makes an
axis's groups, and the pipeline its channel groups, with one ``split_group`` per axis
or round; elsewhere with one ``new_group`` per group. The tests hold the groups made
(each a sorted tuple of ranks) and the world-wide calls, whichever way was taken.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


@dataclass
class GroupSpy:
    calls: list[str] = field(default_factory=list)  # "new_group" or "split_group", in order
    groups: list[tuple[int, ...]] = field(default_factory=list)  # every group made, in order


@contextmanager
def spy_groups() -> Iterator[GroupSpy]:
    spy = GroupSpy()
    real_new, real_split = dist.new_group, dist.split_group

    def new_group(*a: Any, **k: Any) -> Any:
        spy.calls.append("new_group")
        spy.groups.append(tuple(sorted(k.get("ranks", a[0] if a else ()))))
        return real_new(*a, **k)

    def split_group(*a: Any, **k: Any) -> Any:
        spy.calls.append("split_group")
        spy.groups.extend(tuple(sorted(ranks)) for ranks in k["split_ranks"])
        return real_split(*a, **k)

    dist.new_group, dist.split_group = new_group, split_group
    try:
        yield spy
    finally:
        dist.new_group, dist.split_group = real_new, real_split
