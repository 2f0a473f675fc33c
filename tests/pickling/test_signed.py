"""The signed, versioned envelope: everything is checked before a byte is unpickled."""

from __future__ import annotations

import struct
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence import pickling
from cadence.pickling import _signed

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free

KEY = b"k" * 32


@pytest.fixture
def spy(monkeypatch):
    calls: list[bytes] = []
    real = _signed._loads

    def record(data):
        calls.append(data)
        return real(data)

    monkeypatch.setattr(_signed, "_loads", record)
    return calls


def _payload():
    k = 3
    return pickling.dumps_signed(lambda x: x * k, KEY)


def test_round_trip_and_key_rotation(spy, protocol):
    k = 3
    data = pickling.dumps_signed(lambda x: x * k, KEY, protocol=protocol)
    assert pickling.loads_signed(data, KEY)(2) == 6
    assert pickling.loads_signed(data, [b"old-key", KEY])(3) == 9
    assert len(spy) == 2


def test_wrong_key_refused_before_unpickling(spy):
    with pytest.raises(pickling.SignatureError, match="signature check failed"):
        pickling.loads_signed(_payload(), b"another key")
    assert spy == []


def test_foreign_data_refused(spy):
    plain = pickling.dumps(lambda: 1)
    with pytest.raises(pickling.SignatureError, match="not a cadence signed payload"):
        pickling.loads_signed(plain, KEY)
    with pytest.raises(pickling.SignatureError):
        pickling.loads_signed(b"", KEY)
    assert spy == []


def test_forged_python_version_refused(spy):
    data = bytearray(_payload())
    offset = 6 + 1 + 8  # magic, format, impl
    data[offset : offset + 2] = bytes([3, 0])
    with pytest.raises(pickling.SignatureError):  # the tag covers the header
        pickling.loads_signed(bytes(data), KEY)
    assert spy == []


def test_authentic_payload_from_other_python_refused(spy):
    # Re-sign a header claiming Python 3.0 with the right key: it is authentic but
    # incompatible, and the error says which versions are involved.
    import hashlib
    import hmac

    data = _payload()
    header = bytearray(data[: _signed._HEADER.size])
    header[15:17] = bytes([3, 0])
    body = bytes(header) + data[_signed._HEADER.size : -32]
    tag = hmac.new(KEY, _signed.DOMAIN + body, hashlib.sha256).digest()
    with pytest.raises(pickling.IncompatiblePayloadError, match=r"3\.0"):
        pickling.loads_signed(body + tag, KEY)
    assert spy == []


def test_unknown_format_version_refused(spy):
    data = bytearray(_payload())
    data[6] = 99
    with pytest.raises(pickling.IncompatiblePayloadError, match="format version 99"):
        pickling.loads_signed(bytes(data), KEY)
    assert spy == []


def test_header_layout_is_the_documented_one():
    data = _payload()
    magic, fmt, impl, major, minor, _, length = _signed._HEADER.unpack_from(data)
    assert (magic, fmt) == (b"CDNCPK", 1)
    assert impl.rstrip(b"\x00") == b"cpython"
    assert (major, minor) == tuple(sys.version_info[:2])
    assert len(data) == _signed._HEADER.size + length + 32
    assert struct.calcsize(">6sB8s2B4sQ") == _signed._HEADER.size


def test_bad_key_type():
    with pytest.raises(TypeError):
        pickling.dumps_signed(1, "text key")  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_flipped_byte_is_refused_before_unpickling(data):
    payload = _PAYLOAD
    i = data.draw(st.integers(0, len(payload) - 1))
    bit = data.draw(st.integers(0, 7))
    flipped = bytearray(payload)
    flipped[i] ^= 1 << bit
    calls: list[bytes] = []
    real = _signed._loads
    _signed._loads = calls.append  # type: ignore[assignment]
    try:
        with pytest.raises(pickling.EnvelopeError):
            pickling.loads_signed(bytes(flipped), KEY)
    finally:
        _signed._loads = real
    assert calls == []


_PAYLOAD = _payload()
