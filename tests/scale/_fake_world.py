"""One rank of a simulated large world: torch's fake process group, in one process.

torch's ``fake`` backend (``torch.testing._internal.distributed.fake_pg``) accepts any
rank and world size and completes every collective at once without moving data, so
one process can build and step a wrapper exactly as rank ``r`` of ``W`` would, with
every shape, buffer and hook of that world. What it cannot show is the data the
collectives would carry: figures here are sizes and counts, never values.

[Note: counting Python operations]
"Python operations" are the profiler's ``call`` events (a Python function entered)
and ``c_call`` events (a builtin or torch op called from Python), on every thread,
while one callable runs. The same callable is run once uncounted first, in the same
world, so that imports and first-call caches are not counted. Counts are exact and
machine-independent, which is why the tests compare them and never a time.

Every Python function must run the same number of times at every world, and make
the same number of builtin calls, function for function, with one exception: the
equality checks of torch's DTensor caches (``DTensorSpec.__eq__``, its
``_check_equals``, ``DeviceMesh.__eq__`` and the dataclass ``__eq__`` they reach).
A cache lookup compares the key it meets with an equal hash, and how often hashes
meet depends on Python's per-process string-hash randomisation, not on the world:
the same world gives 40, 60 or 100 such calls in different processes, and so do
the others (observed with torch 2.13 and 2.15). They are left out of the comparison
(`Counts.equality` counts them). Work proportional to the world would instead be
thousands of calls at 8192 ranks, in cadence's functions or torch's.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg
from torch import nn

# Importing the module registers the "fake" backend.
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLDS = (64, 1024, 8192)
# torch's equality checks, whose count depends on its caches: see
# [Note: counting Python operations].
EQUALITY = ("__eq__", "_check_equals")
# Every parameter of a block has 2 x 8192 rows: dim-0 chunks divide evenly at every
# world of `WORLDS`, so a rank's share is exactly 1/world of the block.
ROWS = 2 * 8192
WIDTH = 16
BATCH = 8


@contextmanager
def fake_world(world: int, rank: int = 0) -> Iterator[None]:
    """The default process group is rank ``rank`` of a fake world; destroyed on exit."""
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


class Block(nn.Module):
    """A wide MLP block whose parameters all have `ROWS` rows (the sharded dim)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(ROWS, WIDTH) / WIDTH**0.5)
        self.bias = nn.Parameter(torch.zeros(ROWS))
        self.down = nn.Parameter(torch.randn(ROWS, WIDTH) / ROWS**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.up.t() + self.bias) @ self.down


def model() -> nn.Sequential:
    """Two blocks and a BatchNorm: its 16-row parameters pad once the world exceeds 16,
    and its running statistics are the buffers."""
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.BatchNorm1d(WIDTH))


def batch() -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))


def storage_bytes(tensors: Iterator[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: the local shard's)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        s = local.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@dataclass
class Counts:
    """Python operations of one run (see [Note: counting Python operations])."""

    calls: int = 0
    c_calls: int = 0
    by_function: collections.Counter[str] = field(default_factory=collections.Counter)
    # Builtin calls, by the Python function that made them.
    c_by_caller: collections.Counter[str] = field(default_factory=collections.Counter)

    def compared(self) -> collections.Counter[str]:
        """Calls and builtin calls by function, torch's equality checks left out."""
        out: collections.Counter[str] = collections.Counter()
        for prefix, counter in (("call ", self.by_function), ("builtins of ", self.c_by_caller)):
            for k, v in counter.items():
                if not _is_torch_equality(k):
                    out[prefix + k] = v
        return out

    def equality(self) -> int:
        """torch's equality-check calls (reported, not compared)."""
        return sum(v for k, v in self.by_function.items() if _is_torch_equality(k))


def _is_torch_equality(key: str) -> bool:
    return f"{os.sep}cadence{os.sep}" not in key and key.rsplit(":", 1)[-1] in EQUALITY


def assert_same_operations(ref: Counts, got: Counts, what: object) -> None:
    """``got`` ran what ``ref`` ran: see [Note: counting Python operations]."""
    mine, theirs = got.compared(), ref.compared()
    assert mine == theirs, (what, (mine - theirs).most_common(8), (theirs - mine).most_common(8))


def count_operations(fn: Callable[[], Any]) -> tuple[Counts, Any]:
    counts = Counts()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            counts.calls += 1
            code = frame.f_code
            counts.by_function[f"{code.co_filename}:{code.co_firstlineno}:{code.co_name}"] += 1
        elif event == "c_call":
            counts.c_calls += 1
            code = frame.f_code
            counts.c_by_caller[f"{code.co_filename}:{code.co_firstlineno}:{code.co_name}"] += 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return counts, out
