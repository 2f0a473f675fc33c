"""torch's FSDP2 example shape runs on cadence with only its FSDP2 import line changed."""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.fsdp.bodies_fsdp2_example import (
    CADENCE_IMPORTS,
    EXAMPLE,
    TORCH_IMPORTS,
    fsdp2_example,
    switch_imports,
)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("fsdp2_example")
    return run_distributed(fsdp2_example, str(directory), world_size=2, timeout=240)


def test_the_cadence_variant_differs_only_in_the_import_line() -> None:
    torch_lines = EXAMPLE.read_text().splitlines(keepends=True)
    cadence_lines = switch_imports(EXAMPLE.read_text()).splitlines(keepends=True)
    changed = [(a, b) for a, b in zip(torch_lines, cadence_lines) if a != b]
    assert len(torch_lines) == len(cadence_lines) and changed == [(TORCH_IMPORTS, CADENCE_IMPORTS)]


@pytest.mark.parametrize("phase", ["losses", "continued", "resumed_per_rank", "resumed_dcp"])
def test_losses_are_bitwise_equal_under_torch_and_cadence(
    results: list[dict[str, Any]], phase: str
) -> None:
    for rank, r in enumerate(results):
        assert r["cadence"][phase] == r["torch"][phase], (rank, r["torch"], r["cadence"])


def test_resumed_runs_continue_as_the_uninterrupted_run(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        for variant in ("torch", "cadence"):
            run = r[variant]
            assert run["resumed_per_rank"] == run["continued"], (rank, variant, run)
            assert run["resumed_dcp"] == run["continued"], (rank, variant, run)


@pytest.mark.parametrize("saved", ["model_file", "optim_file"])
def test_per_rank_checkpoints_are_equal_under_torch_and_cadence(
    results: list[dict[str, Any]], saved: str
) -> None:
    for rank, r in enumerate(results):
        assert r[f"{saved}_unequal"] == [], (rank, r[f"{saved}_unequal"])


def test_distributed_checkpoints_are_equal_under_torch_and_cadence(
    results: list[dict[str, Any]],
) -> None:
    assert results[0]["dcp_unequal"] == [], results[0]["dcp_unequal"]
