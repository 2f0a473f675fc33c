"""One test per DataParallel misuse error: each names the cause and the fix."""

from __future__ import annotations

from typing import Any

import pytest

CASES = [
    "forward_pending",
    "step_pending",
    "second_backward",
    "finalize_too_early",
    "setter_in_backward",
    "manual_toggle_in_backward",
    "second_finalize_before_wait",
    "forward_before_wait",
    "wait_idempotent",
    "finalize_nothing_pending",
    "missing_grad",
    "failed_state",
    "after_reset",
    "mismatch",
]


@pytest.fixture(scope="module")
def misuse(world2: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [r["misuse"] for r in world2]


@pytest.mark.parametrize("case", CASES)
def test_misuse(misuse: list[dict[str, str]], case: str) -> None:
    for rank, r in enumerate(misuse):
        assert r[case] == "ok", f"rank {rank}: {r[case]}"
