"""Precompile tests compile on 2 shared cores: no inductor worker pool in any process."""

from __future__ import annotations

import os
from typing import Any

import pytest

from cadence.precompiling import _torch_aot
from tests.precompiling import _bodies

# Inherited by the ranks and scripts the tests start. A pool of compile workers costs a
# process start per core and buys nothing for the tiny graphs compiled here.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the artifacts torch's loader was given (a call means bytes were
    unpickled); clears the flag a planted payload sets when it runs."""
    calls: list[int] = []
    real = _torch_aot.deserialize

    def counting(data: bytes) -> Any:
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(_torch_aot, "deserialize", counting)
    _bodies.FLAG.clear()
    return calls
