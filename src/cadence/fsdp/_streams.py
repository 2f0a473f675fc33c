"""CUDA streams for the collectives, and a no-op stand-in on CPU.

[Note: streams and events]
On CUDA the all-gather and the reduce-scatter are issued from their own streams,
which first wait on the compute stream (so they read finished shards / gradients).
Completion is a ``Work.wait()``, which on NCCL makes the *current* stream wait on the
collective: the host never blocks or polls on the hot path, which also keeps the
forward + backward + finalize sequence capturable. Buffers that cross streams are
``record_stream``-ed so the caching allocator does not reuse them too early.
On CPU (gloo) every method is a no-op: gloo runs async work on its own threads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["StreamSet"]


class StreamSet:
    """The side streams of one runtime (CUDA), or nothing (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.all_gather: torch.cuda.Stream | None = None
        self.reduce_scatter: torch.cuda.Stream | None = None
        if self.cuda:
            self.all_gather = torch.cuda.Stream(device)
            self.reduce_scatter = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def issue(self, kind: str) -> Iterator[None]:
        """Run the body (allocation + collective issue) on the ``kind`` side stream."""
        stream = self.all_gather if kind == "all_gather" else self.reduce_scatter
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield

    def used_by(self, tensor: torch.Tensor, kind: str | None = None) -> None:
        """Tell the allocator ``tensor`` is used on a stream other than its own.

        ``kind=None`` means the current (compute) stream.
        """
        if not self.cuda:
            return
        stream: torch.cuda.Stream | None
        if kind is None:
            stream = torch.cuda.current_stream()
        else:
            stream = self.all_gather if kind == "all_gather" else self.reduce_scatter
        assert stream is not None
        tensor.record_stream(stream)
