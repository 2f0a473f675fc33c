"""Reading a verified checkpoint through DCP: each file checked as it is opened, and
no object unpickled beyond torch's weights-only loader, save DCP's ``.metadata``.

See [Note: a checkpoint is verified before anything in it is unpickled] in
``checkpoint.py``.
"""

from __future__ import annotations

import io
import os
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import ReadItem

from cadence.train._errors import ResumeRefusedError
from cadence.train._manifest import open_verified

__all__ = ["CheckedReader", "WeightsOnlyPlanner"]


class _CheckedFileSystem(FileSystem):
    """DCP's local filesystem, opening a file for reading only through `open_verified`."""

    def __init__(self, files: dict[str, dict[str, Any]]) -> None:
        super().__init__()
        self._files = files

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        entry = self._files.get(path.name)
        if entry is None:
            raise ResumeRefusedError(
                f"DCP asked for {path}, which the checkpoint's manifest does not list: "
                "start over with --overwrite"
            )
        with open_verified(path, entry, " (checked again as it was read)") as stream:
            yield stream  # type: ignore[misc]  # an IO[bytes] file, typed apart from IOBase


class CheckedReader(FileSystemReader):
    """DCP's reader of ``folder``; with ``files`` (the verified manifest's entries) every
    file it opens, ``.metadata`` first, is read through the descriptor its sha256 was
    checked on. Without (a checkpoint from before content hashes, vouched for by
    ``--trust-checkpoint``), DCP's plain reader."""

    def __init__(
        self, folder: str | os.PathLike[str], files: dict[str, dict[str, Any]] | None
    ) -> None:
        super().__init__(folder)
        if files is not None:
            # FileSystemReader opens every file through self.fs (torch 2.13 to 2.15).
            self.fs = _CheckedFileSystem(files)


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items (the optimizer's param
    groups, an older checkpoint's history) with torch's weights-only loader, which
    builds plain containers, numbers, strings and tensors only, instead of the full
    unpickler DCP uses for them."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        # Handed on as bytes to the parent's bookkeeping (flattened keys, nested
        # dicts); it unpickles them in full, but they now hold only what the
        # weights-only loader built.
        again = io.BytesIO()
        torch.save(obj, again)
        again.seek(0)
        super().load_bytes(read_item, again)
