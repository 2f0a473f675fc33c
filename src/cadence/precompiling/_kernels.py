"""Shipping inductor's compiled C++ kernels with an artifact.

An artifact compiled by inductor for CPU carries the C++ source of its kernels; loading
it on a node whose inductor cache lacks them runs g++ again, which costs about as much
CPU as the compile itself (measured in docs/precompile.md). The libraries the compile
built are therefore bundled with the artifact (``kernels`` section) and written into the
loading node's inductor cache before the artifact is loaded, where inductor finds them
and skips the build.

The bundle is a flat list of ``(relative path, bytes)`` in a length-prefixed format, not
a pickle. Unpacking accepts only ``<2 chars>/<name>.so|.o`` paths, never overwrites an
existing file and writes each one atomically. The libraries are native code: they are
covered by the artifact's signature like the rest of it, and the cache key pins the CPU
ISA and the compiler, so a library never reaches a machine it was not built for.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import tempfile
from pathlib import Path

__all__ = ["files_for", "pack", "snapshot", "unpack"]

_NAME = re.compile(r"^[a-z0-9]{2}/[A-Za-z0-9_.\-]+\.(so|o)$")
_COUNT = struct.Struct(">I")
_ENTRY = struct.Struct(">HQ")
_MAX_FILE = 1 << 30


def snapshot(cache_dir: str) -> set[str]:
    """The library files in ``cache_dir`` now, as relative paths."""
    root = Path(cache_dir)
    return {
        f"{p.parent.name}/{p.name}"
        for p in root.glob("??/*")
        if _NAME.match(f"{p.parent.name}/{p.name}")
    }


def files_for(keys: set[str], cache_dir: str, new: set[str]) -> dict[str, bytes]:
    """The libraries of these kernel keys, plus ``new`` ones (built during the compile:
    inductor's CPU ISA probes are among them), as ``{relative path: bytes}``."""
    root = Path(cache_dir)
    names = set(new)
    for key in keys:
        folder = root / key[1:3]
        if folder.is_dir():
            names.update(f"{folder.name}/{p.name}" for p in folder.glob(f"{key}*"))
    out: dict[str, bytes] = {}
    for name in sorted(names):
        path = root / name
        if _NAME.match(name) and path.is_file():
            out[name] = path.read_bytes()
    return out


def pack(files: dict[str, bytes]) -> bytes:
    parts = [_COUNT.pack(len(files))]
    for name, data in files.items():
        raw = name.encode()
        parts += [_ENTRY.pack(len(raw), len(data)), raw, data]
    return b"".join(parts)


def _entries(bundle: bytes) -> list[tuple[str, bytes]]:
    (count,) = _COUNT.unpack_from(bundle)
    offset, out = _COUNT.size, []
    for _ in range(count):
        name_len, size = _ENTRY.unpack_from(bundle, offset)
        offset += _ENTRY.size
        name = bundle[offset : offset + name_len].decode()
        offset += name_len
        if not _NAME.match(name) or size > _MAX_FILE:
            raise ValueError(f"refusing kernel bundle entry {name!r}")
        out.append((name, bundle[offset : offset + size]))
        offset += size
    if offset != len(bundle):
        raise ValueError("kernel bundle length does not add up")
    return out


def unpack(bundle: bytes, cache_dir: str) -> int:
    """Write the bundle's libraries that ``cache_dir`` lacks; returns how many were written."""
    written = 0
    root = Path(cache_dir)
    for name, data in _entries(bundle):
        target = root / name
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".cadence-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o755)
            os.link(tmp, target)  # fails if a build of the same kernel got there first
            written += 1
        except FileExistsError:
            pass
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return written
