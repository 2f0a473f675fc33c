"""Communication hooks with torch DDP's signature: ``hook(state, bucket) -> Future | work``.

A hook receives the bucket's flat buffer **un-divided** (the DDP contract) and
is responsible for averaging. It returns either a ``torch.futures.Future`` whose
value is the reduced buffer (so torch's own DDP hooks work unchanged), or an
object with ``wait()`` / ``is_completed()`` after which the buffer holds the
result in place. The built-in hooks below go through `cadence.Comm`, so they are
counted in the wrapper's event log.
"""

from __future__ import annotations

from typing import Any

import torch

from cadence.comm import Comm, CommWork
from cadence.data_parallel._buckets import Bucket

__all__ = ["GradBucket", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]


class GradBucket:
    """The view of one bucket a hook gets (method names follow ``dist.GradBucket``)."""

    def __init__(self, bucket: Bucket, comm: Comm, *, is_last: bool) -> None:
        self._bucket = bucket
        self.comm = comm
        self._is_last = is_last

    def index(self) -> int:
        return int(self._bucket.index)

    def buffer(self) -> torch.Tensor:
        return self._bucket.buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._bucket.buffer.copy_(tensor.reshape(-1))

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._is_last


class _CastBack:
    """Waits a compressed all-reduce, then writes it back into the full-precision buffer."""

    def __init__(self, work: CommWork, compressed: torch.Tensor, buffer: torch.Tensor) -> None:
        self._work = work
        self._compressed = compressed
        self._buffer = buffer
        self._done = False

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()

    def wait(self) -> None:
        if self._done:
            return
        self._work.wait()
        self._buffer.copy_(self._compressed)
        self._done = True


def _comm(state: Any, bucket: GradBucket) -> Comm:
    return state if isinstance(state, Comm) else bucket.comm


def allreduce_hook(state: Any, bucket: GradBucket) -> CommWork:
    """Average the bucket with one all-reduce (what DataParallel does without a hook)."""
    comm = _comm(state, bucket)
    buf = bucket.buffer()
    buf.div_(comm.world_size)
    return comm.all_reduce(buf, async_op=True)


def _compress_hook(dtype: torch.dtype, state: Any, bucket: GradBucket) -> _CastBack:
    comm = _comm(state, bucket)
    buf = bucket.buffer()
    # Divide before the reduction, in full precision, so fp16 cannot overflow.
    compressed = buf.div(comm.world_size).to(dtype)
    return _CastBack(comm.all_reduce(compressed, async_op=True), compressed, buf)


def fp16_compress_hook(state: Any, bucket: GradBucket) -> _CastBack:
    """All-reduce in fp16 (half the bytes on the wire), write back in the grad dtype."""
    return _compress_hook(torch.float16, state, bucket)


def bf16_compress_hook(state: Any, bucket: GradBucket) -> _CastBack:
    """All-reduce in bf16, write back in the grad dtype."""
    return _compress_hook(torch.bfloat16, state, bucket)
