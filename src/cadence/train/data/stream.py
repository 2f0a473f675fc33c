"""`TokenStream`: several 1-D token arrays (memory maps, mostly) read as one sequence.

A folder of shards or of text files is many arrays; copying them into one would
read every byte into memory on every rank. The stream keeps the arrays as they are
and reads a window by position, crossing from one array into the next where the
window does (a few rows per step, so a Python loop per row costs nothing next to a
training step).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["TokenStream"]


class TokenStream:
    """Tokens ``[start, stop)`` of the concatenation of ``pieces`` (1-D integer arrays)."""

    def __init__(
        self,
        pieces: Sequence[npt.NDArray[np.unsignedinteger[Any]]],
        start: int = 0,
        stop: int | None = None,
    ):
        self.pieces = tuple(pieces)
        self.offsets = [0]
        for p in self.pieces:
            self.offsets.append(self.offsets[-1] + len(p))
        total = self.offsets[-1]
        self.start = start
        self.stop = total if stop is None else stop
        if not 0 <= self.start <= self.stop <= total:
            raise ValueError(f"TokenStream [{start}, {stop}) lies outside 0..{total}")

    def __len__(self) -> int:
        return self.stop - self.start

    def slice(self, start: int, stop: int) -> TokenStream:
        """Tokens ``[start, stop)`` of this stream, as a stream over the same arrays."""
        if not 0 <= start <= stop <= len(self):
            raise ValueError(f"slice [{start}, {stop}) lies outside 0..{len(self)}")
        return TokenStream(self.pieces, self.start + start, self.start + stop)

    def read(self, start: int, length: int) -> npt.NDArray[np.int64]:
        """Tokens ``[start, start + length)`` of this stream as int64."""
        if start < 0 or length < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) lie outside 0..{len(self)}")
        pos, end = self.start + start, self.start + start + length
        out = np.empty(length, dtype=np.int64)
        filled = 0
        i = bisect.bisect_right(self.offsets, pos) - 1
        while filled < length:
            piece, base = self.pieces[i], self.offsets[i]
            lo, hi = pos - base, min(end, self.offsets[i + 1]) - base
            out[filled : filled + hi - lo] = piece[lo:hi]
            filled += hi - lo
            pos = base + hi
            i += 1
        return out

    def max_token(self) -> int:
        """The largest token id in the stream (-1 when empty): one pass over the arrays."""
        best = -1
        for i, piece in enumerate(self.pieces):
            lo = max(self.start - self.offsets[i], 0)
            hi = min(self.stop - self.offsets[i], len(piece))
            if lo < hi:
                best = max(best, int(piece[lo:hi].max()))
        return best
