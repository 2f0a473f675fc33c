"""Manual finalization: ``.grad`` cannot be clipped, stepped on or read before it is reduced."""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.foundation.bodies_pending_grads import pending_grads_body

CASES = [f"kind={k},mode={m}" for k in ("dp", "fsdp") for m in ("blocking", "async")]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(pending_grads_body, world_size=2, timeout=120)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("misuse", ["clip", "step", "read", "zero_in_place"])
def test_misuse_names_finalize_backward(
    results: list[dict[str, Any]], case: str, misuse: str
) -> None:
    for rank, r in enumerate(results):
        assert r[case][misuse] == "ok", (rank, case, r[case][misuse])


@pytest.mark.parametrize("case", CASES)
def test_grads_after_finalize_are_the_reduced_ones(
    results: list[dict[str, Any]], case: str
) -> None:
    for r in results:
        c = r[case]
        assert c["metadata"] == 1.0 and c["repr"], c  # shape and `is None` checks still work
        assert c["after"] < 1e-6, c  # same as automatic finalization
        assert c["clip_after"] > 0, c
        assert c["after_reset"] != "PendingGrad", c
