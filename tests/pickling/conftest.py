"""The pickling suite runs under protocols 4 and 5 (every test that pickles takes
``protocol``), as cloudpickle's own suite reruns itself per protocol."""

from __future__ import annotations

import pytest

from tests.pickling._harness import PROTOCOLS


@pytest.fixture(params=PROTOCOLS, ids=[f"p{p}" for p in PROTOCOLS])
def protocol(request: pytest.FixtureRequest) -> int:
    return request.param
