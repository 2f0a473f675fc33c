"""The artifact file: a signed, versioned header, checked before a byte is unpickled.

Layout (integers big-endian)::

    magic     8 bytes   b"CDNCAOT\\x00"
    format    2 bytes   FORMAT_VERSION
    hlen      4 bytes   length of the header
    header    hlen      JSON: the cache key's fields, section lengths, provenance
    sections  ...       the serialized function, then (optionally) the kernel bundle
    tag       32 bytes  HMAC-SHA256(key, DOMAIN + everything above)

[Note: precompile artifact checks]
`decode` refuses, in this order and before anything is unpickled: a short file, a
wrong magic, another format version, a header length out of bounds, and a tag that
does not verify (one flipped bit anywhere, a truncated file, an edited header or
kernel). Only then is the JSON header parsed, and `ArtifactCache.read` compares its
fields with the caller's key: another torch, Python, CPU ISA or compiler, or an edited
source, is refused by name. Each refusal is an `ArtifactRefused` with a reason; the
caller warns and compiles again, so a bad file costs one compile, never a crash and
never stale code.

[Note: precompile cache key file]
The HMAC key is 32 random bytes in ``<cache_dir>/.cadence-precompile.key`` (mode
0600), created on first use, atomically, by whichever process gets there first. It
makes corruption and truncation detectable and keeps artifacts from another cache
directory (another key) from being loaded. A tag proves only that the file was signed
by someone holding the key file, so the key is worth exactly as much as the control
over that file: someone who can write the directory need not read the key, they can
rename it away and put their own (or a symlink to theirs) in its place, then sign an
artifact with it, and loading an artifact runs its code (pickle, and on CPU the C++
kernels it compiles). So `ArtifactCache` trusts the directory and the key only when
the current user alone controls them (`cadence._util.owned`, [Note: trusting a key on
disk]): the directory is owned by the user and writable by nobody else, every folder
above it is the user's or root's and, if others may write it, sticky; the key is a
regular file, not a symlink, owned by the user, mode 0600, checked on the open
descriptor. Otherwise it raises `UntrustedPathError` naming the path and the fix, and
nothing is read from the directory or written to it. The path is resolved first, so a
symlink to a private folder (``~/.cache`` on another disk) works: every check applies
to the real folder. What it cannot stop is the user's own account, or root: a cache
directory holds code and is as trusted as its owner.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import socket
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from cadence._util.owned import make_private_dir, read_or_create_key
from cadence.precompiling._errors import ArtifactRefused
from cadence.precompiling._key import FORMAT_VERSION, Key

__all__ = [
    "KEY_FILE",
    "ArtifactCache",
    "ArtifactRefused",
    "check",
    "decode",
    "encode",
    "make_header",
]

MAGIC = b"CDNCAOT\x00"
DOMAIN = b"cadence.precompile.artifact/v1\x00"
KEY_FILE = ".cadence-precompile.key"
_PREFIX = struct.Struct(">8sHI")
_TAG = 32
_MAX_HEADER = 64 << 20


def encode(header: dict[str, Any], sections: dict[str, bytes], key: bytes) -> bytes:
    names = list(sections)
    head = dict(header, sections=[[n, len(sections[n])] for n in names])
    head_bytes = json.dumps(head, sort_keys=True, default=str).encode()
    body = b"".join(
        [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(head_bytes)), head_bytes]
        + [sections[n] for n in names]
    )
    return body + hmac.new(key, DOMAIN + body, hashlib.sha256).digest()


def decode(
    data: bytes, key: bytes, *, other_key: str = "another cache's key"
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Verify ``data`` and split it; raises `ArtifactRefused` before any unpickling.

    ``other_key`` names, in the refusal, whose key a valid-looking artifact that does
    not verify was probably signed with.
    """
    if len(data) < _PREFIX.size + _TAG:
        raise ArtifactRefused(f"corrupt: {len(data)} bytes is shorter than any artifact")
    magic, fmt, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise ArtifactRefused("corrupt: not a cadence precompile artifact (bad magic)")
    if fmt != FORMAT_VERSION:
        raise ArtifactRefused(
            f"incompatible: artifact format {fmt}, this cadence reads format {FORMAT_VERSION}"
        )
    if hlen > min(_MAX_HEADER, len(data) - _PREFIX.size - _TAG):
        raise ArtifactRefused("corrupt: the header length runs past the end (truncated?)")
    body, tag = data[:-_TAG], data[-_TAG:]
    if not hmac.compare_digest(hmac.new(key, DOMAIN + body, hashlib.sha256).digest(), tag):
        raise ArtifactRefused(
            "corrupt: the signature does not verify (truncated, edited, or signed with "
            f"{other_key})"
        )
    try:
        header = json.loads(body[_PREFIX.size : _PREFIX.size + hlen])
        offset = _PREFIX.size + hlen
        sections: dict[str, bytes] = {}
        for name, size in header["sections"]:
            sections[name] = body[offset : offset + size]
            offset += size
    except (ValueError, KeyError, TypeError) as exc:
        raise ArtifactRefused(f"corrupt: unreadable header ({exc})") from None
    if offset != len(body):
        raise ArtifactRefused("corrupt: section lengths do not add up")
    return header, sections


class ArtifactCache:
    """Artifacts in one directory, signed with that directory's key.

    Raises `cadence._util.owned.UntrustedPathError` when someone other than the current user
    could have written the directory or the key; see [Note: precompile cache key file].
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = make_private_dir(
            Path(directory).expanduser().resolve(), "the precompile cache directory"
        )
        self.key = read_or_create_key(self.directory / KEY_FILE, "the precompile cache key")

    def path(self, key: Key) -> Path:
        return self.directory / key.filename()

    def read(self, key: Key) -> tuple[dict[str, Any], dict[str, bytes]] | None:
        """The verified artifact for ``key``; None if absent; `ArtifactRefused` if unusable."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        return check(decode(data, self.key), key)

    def write(self, key: Key, header: dict[str, Any], sections: dict[str, bytes]) -> Path:
        """Write atomically: a reader sees the old file or the new one, never half of one."""
        path = self.path(key)
        data = encode(header, sections, self.key)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".cpc")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path


def check(
    decoded: tuple[dict[str, Any], dict[str, bytes]], key: Key
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Compare an authentic artifact's recorded key with ``key``; refuse any difference."""
    header, sections = decoded
    recorded = header.get("key")
    if not isinstance(recorded, dict):
        raise ArtifactRefused("corrupt: the header records no key")
    differences = key.diff(recorded)
    if differences:
        stale = all(d.startswith(("source of", "captured value")) for d in differences)
        kind = "stale" if stale else "incompatible"
        raise ArtifactRefused(f"{kind}: " + "; ".join(differences[:8]))
    if "artifact" not in sections:
        raise ArtifactRefused("corrupt: no serialized function in the artifact")
    return header, sections


def make_header(key: Key, **provenance: Any) -> dict[str, Any]:
    return {
        "key": key.fields,
        "created": time.time(),
        "host": socket.gethostname(),
        **provenance,
    }
