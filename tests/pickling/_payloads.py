"""Hand-written pickle opcodes: what a hostile peer sends to a restricted load.

Each helper returns the bytes of one fragment (names follow ``pickletools``); `payload`
wraps fragments in a PROTO header and STOP. `ran_code` is how a test tells that a
payload ran code: the code a payload smuggles in creates a marker file.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

FXH = "tests.pickling.fixtures.fx_hostile"


def text(s: str) -> bytes:
    """SHORT_BINUNICODE or BINUNICODE."""
    raw = s.encode()
    if len(raw) < 256:
        return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def integer(n: int) -> bytes:
    """BININT."""
    return pickle.BININT + struct.pack("<i", n)


def stack_global(module: str, name: str) -> bytes:
    """STACK_GLOBAL (protocol 4): ``name`` may hold dots."""
    return text(module) + text(name) + pickle.STACK_GLOBAL


def global_op(module: str, name: str) -> bytes:
    """GLOBAL, the protocol 0 opcode: module and name as text lines."""
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def tuple_of(*items: bytes) -> bytes:
    return pickle.MARK + b"".join(items) + pickle.TUPLE


def call(func: bytes, *args: bytes) -> bytes:
    """REDUCE: ``func(*args)``."""
    return func + tuple_of(*args) + pickle.REDUCE


def dict_of(*pairs: tuple[bytes, bytes]) -> bytes:
    """EMPTY_DICT, then SETITEMS."""
    body = b"".join(k + v for k, v in pairs)
    return pickle.EMPTY_DICT + (pickle.MARK + body + pickle.SETITEMS if pairs else b"")


def build(target: bytes, state: bytes) -> bytes:
    """BUILD: ``state`` applied to ``target`` (``__setstate__``, ``__dict__`` or setattr)."""
    return target + state + pickle.BUILD


def slot_state(*pairs: tuple[bytes, bytes]) -> bytes:
    """A ``(None, {name: value})`` state: BUILD sets each name with ``setattr``."""
    return pickle.NONE + dict_of(*pairs) + pickle.TUPLE2


def payload(*parts: bytes, protocol: int = 4) -> bytes:
    return pickle.PROTO + bytes([protocol]) + b"".join(parts) + pickle.STOP


def marker_code(marker: Path) -> str:
    """Python source that creates ``marker``: what a payload that reaches exec runs."""
    return f"open({str(marker)!r}, 'x').close()"


def ran_code(marker: Path) -> bool:
    return marker.exists()
