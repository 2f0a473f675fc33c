"""A signed, versioned envelope around a payload: ``dumps_signed`` / ``loads_signed``.

Loading a by-value function payload runs code by construction; no restricted unpickler
can change that without removing the feature. What can be checked is *who* made the
payload and *for which interpreter*, and both checks happen before a single payload byte
reaches the unpickler.

Layout (all integers big-endian)::

    magic       6 bytes   b"CDNCPK"
    format      1 byte    FORMAT_VERSION
    impl        8 bytes   sys.implementation.name, ASCII, NUL-padded
    py_version  2 bytes   major, minor
    bc_magic    4 bytes   importlib.util.MAGIC_NUMBER (bytecode format)
    length      8 bytes   payload length
    payload     length bytes
    tag         32 bytes  HMAC-SHA256(key, DOMAIN + everything above)

The tag covers the header, so a forged version field fails the tag check; the domain
prefix keeps a tag made for this format from verifying anything else with the same key.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.util
import pickle
import struct
import sys
from collections.abc import Sequence
from typing import Any

from cadence.pickling._errors import EnvelopeError, IncompatiblePayloadError, SignatureError
from cadence.pickling._pickler import dumps
from cadence.pickling._restricted import Allowlist, loads_restricted

# Everything not listed here is private to cadence.pickling.
__all__ = [
    "FORMAT_VERSION",
    "EnvelopeError",  # defined in _errors; also importable from here, where it used to be
    "IncompatiblePayloadError",
    "SignatureError",
    "dumps_signed",
    "loads_signed",
]

MAGIC = b"CDNCPK"
FORMAT_VERSION = 1
DOMAIN = b"cadence.pickling.signed/v1\x00"
_HEADER = struct.Struct(">6sB8s2B4sQ")
_TAG_LEN = 32


def _impl() -> bytes:
    return sys.implementation.name.encode("ascii")[:8].ljust(8, b"\x00")


def _check_key(key: Any) -> None:
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise TypeError("the signing key must be non-empty bytes")


def dumps_signed(obj: Any, key: bytes, protocol: int | None = None) -> bytes:
    """Pickle ``obj`` (as :func:`dumps`) inside a signed, versioned envelope."""
    _check_key(key)
    payload = dumps(obj, protocol=protocol)
    major, minor = sys.version_info[:2]
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, _impl(), major, minor, importlib.util.MAGIC_NUMBER, len(payload)
    )
    tag = hmac.new(bytes(key), DOMAIN + header + payload, hashlib.sha256).digest()
    return header + payload + tag


def loads_signed(
    data: bytes, key: bytes | Sequence[bytes], *, allow: Allowlist | None = None
) -> Any:
    """Verify and load a payload made by :func:`dumps_signed`.

    ``key`` may be a sequence of keys (key rotation): any one that verifies is accepted.
    Raises :class:`SignatureError` or :class:`IncompatiblePayloadError` before any byte
    is unpickled. With ``allow``, the verified payload is loaded with
    :func:`loads_restricted` (a signed *and* restricted load).
    """
    keys = [key] if isinstance(key, (bytes, bytearray)) else list(key)
    for k in keys:
        _check_key(k)
    data = bytes(data)
    if len(data) < _HEADER.size + _TAG_LEN or not data.startswith(MAGIC):
        raise SignatureError("not a cadence signed payload (bad magic or truncated)")
    if data[len(MAGIC)] != FORMAT_VERSION:
        raise IncompatiblePayloadError(
            f"signed payload format version {data[len(MAGIC)]} is not supported "
            f"(this cadence reads version {FORMAT_VERSION})"
        )
    _, _, impl, major, minor, bc_magic, length = _HEADER.unpack_from(data)
    if _HEADER.size + length + _TAG_LEN != len(data):
        raise SignatureError("signed payload length does not match its header (truncated?)")
    body = data[: _HEADER.size + length]
    tag = data[_HEADER.size + length :]
    if not any(
        hmac.compare_digest(hmac.new(bytes(k), DOMAIN + body, hashlib.sha256).digest(), tag)
        for k in keys
    ):
        raise SignatureError(
            "signature check failed: the payload was tampered with or signed with another key"
        )
    here = (sys.implementation.name, sys.version_info[0], sys.version_info[1])
    there = (impl.rstrip(b"\x00").decode("ascii", "replace"), major, minor)
    if there != here or bc_magic != importlib.util.MAGIC_NUMBER:
        raise IncompatiblePayloadError(
            f"payload was made by {there[0]} {there[1]}.{there[2]} (bytecode magic "
            f"{bc_magic.hex()}); this is {here[0]} {here[1]}.{here[2]} (bytecode magic "
            f"{importlib.util.MAGIC_NUMBER.hex()}): by-value code does not cross versions"
        )
    payload = data[_HEADER.size : _HEADER.size + length]
    if allow is not None:
        return loads_restricted(payload, allow)
    return _loads(payload)


_loads = pickle.loads  # module attribute so tests can prove it is not reached
