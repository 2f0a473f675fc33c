"""Token shards: files of token ids, memory-mapped, in the two formats in common use.

- nanoGPT (``prepare.py`` writes ``train.bin`` / ``val.bin``): the ids and nothing else,
  little-endian ``uint16`` (``--data-dtype uint32`` for a vocabulary past 65536);
- llm.c (``dev/data/*.py`` writes ``*_train_*.bin`` / ``*_val_*.bin``): a header of 256
  little-endian int32 (1024 bytes), then the ids. ``header[0]`` is the magic, which
  also says the id type: 20240520 (GPT-2, version 1) ids are ``uint16``, 20240801
  (LLaMA 3, version 7) ids are ``uint32``; ``header[2]`` is the token count.

A file is read as llm.c's when its first int32 is one of those magics; the header's
type then wins, and a ``--data-dtype`` that disagrees is refused. A flat file whose
first two ids spell a magic (54568 then 308 for uint16) would be taken for a header,
and refused unless its token count and size agree, which by chance they do not.

Torch-free: `cadence.train.preflight` reads shards before any rank starts.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from cadence.train._errors import TrainConfigError

__all__ = ["DTYPES", "LLMC_HEADER_BYTES", "LLMC_MAGICS", "Shard", "open_shard", "shard_max"]

DTYPES: dict[str, np.dtype[np.unsignedinteger[Any]]] = {
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
}
LLMC_HEADER_BYTES = 256 * 4
# magic -> (version, id type), as llm.c's dev/data/data_common.py writes them.
LLMC_MAGICS: dict[int, tuple[int, str]] = {20240520: (1, "uint16"), 20240801: (7, "uint32")}


@dataclass(frozen=True)
class Shard:
    """One shard: its ids as a read-only memory map, and how the file was read."""

    path: Path
    tokens: npt.NDArray[np.unsignedinteger[Any]]
    dtype: str
    llmc: bool
    """The file has llm.c's header."""


def _header(path: Path) -> npt.NDArray[np.int32] | None:
    """llm.c's header of ``path``, or None when the file does not start with a magic."""
    with open(path, "rb") as f:
        head = f.read(LLMC_HEADER_BYTES)
    if len(head) < LLMC_HEADER_BYTES:
        return None
    header = np.frombuffer(head, dtype="<i4")
    return header if int(header[0]) in LLMC_MAGICS else None


def open_shard(path: Path, dtype: str = "") -> Shard:
    """Memory-map the shard ``path``; ``dtype`` "" reads llm.c's header where there is
    one, else uint16. Refuses (`TrainConfigError`) a file that cannot be a shard."""
    flag = f"--data {path}"
    try:
        size = path.stat().st_size
        header = _header(path)
    except OSError as exc:
        raise TrainConfigError(
            f"{flag}: cannot be read ({exc.strerror}); give a readable file"
        ) from exc
    if header is not None:
        magic, version, count = (int(v) for v in header[:3])
        want_version, kind = LLMC_MAGICS[magic]
        if version != want_version:
            raise TrainConfigError(
                f"{flag}: llm.c header with magic {magic} but version {version} (expected "
                f"{want_version}); rewrite the shard with llm.c's dev/data scripts"
            )
        if dtype and dtype != kind:
            raise TrainConfigError(
                f"{flag}: its llm.c header says {kind} ids, but --data-dtype is {dtype}; "
                "drop --data-dtype (the header decides)"
            )
        body = size - LLMC_HEADER_BYTES
        if body != count * DTYPES[kind].itemsize:
            raise TrainConfigError(
                f"{flag}: its llm.c header says {count} tokens ({count * DTYPES[kind].itemsize} "
                f"bytes of {kind}) but {body} bytes follow it: the file is cut short or not "
                "a shard; write it again"
            )
        tokens = _memmap(path, kind, LLMC_HEADER_BYTES, count)
        return Shard(path, tokens, kind, True)
    kind = dtype or "uint16"
    width = DTYPES[kind].itemsize
    if size % width:
        raise TrainConfigError(
            f"{flag}: {size} bytes is not a whole number of {kind} ids ({width} bytes each); "
            "give the --data-dtype it was written with (uint16 or uint32)"
        )
    return Shard(path, _memmap(path, kind, 0, size // width), kind, False)


def _memmap(
    path: Path, dtype: str, offset: int, count: int
) -> npt.NDArray[np.unsignedinteger[Any]]:
    if count == 0:  # numpy cannot map zero bytes
        return np.empty(0, dtype=DTYPES[dtype])
    return np.memmap(path, dtype=DTYPES[dtype], mode="r", offset=offset, shape=(count,))


def shard_max(shard: Shard) -> int:
    """The largest id in ``shard`` (-1 when empty); remembered per file version."""
    st = os.stat(shard.path)
    return _max_of(str(shard.path), st.st_size, st.st_mtime_ns, shard.dtype, shard.llmc)


@functools.lru_cache(maxsize=256)
def _max_of(path: str, size: int, mtime_ns: int, dtype: str, llmc: bool) -> int:
    # One full pass at disk speed: exact, unlike a sample, and a vocabulary refused
    # here is a crash avoided inside every rank. The key holds size and mtime, so a
    # rewritten file is scanned again; the CLI asks twice (the vocabulary, the check).
    shard = open_shard(Path(path), dtype)
    return int(shard.tokens.max()) if len(shard.tokens) else -1
