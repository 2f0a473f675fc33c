"""Per-rank state dicts and DCP checkpoints move both ways between torch FSDP2 and cadence."""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.fsdp.bodies_cross_load import cross_load


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("cross_load")
    return run_distributed(cross_load, str(directory), world_size=2, timeout=240)


@pytest.mark.parametrize("case", ["torch_to_cadence", "cadence_to_torch"])
def test_per_rank_model_state_dict_loads_bitwise_across_libraries(
    results: list[dict[str, Any]], case: str
) -> None:
    for rank, r in enumerate(results):
        assert r[case]["differs_before"], (rank, r[case])  # the load changed something
        assert r[case]["model_equal"], (rank, r[case])  # full_tensor() of every entry


@pytest.mark.parametrize("case", ["torch_to_cadence", "cadence_to_torch"])
def test_per_rank_optimizer_state_dict_loads_bitwise_across_libraries(
    results: list[dict[str, Any]], case: str
) -> None:
    for rank, r in enumerate(results):
        assert r[case]["optim_equal"], (rank, r[case])  # exp_avg, exp_avg_sq, step


@pytest.mark.parametrize("case", ["torch_to_cadence", "cadence_to_torch"])
def test_training_after_switching_libraries_matches_the_run_that_never_switched(
    results: list[dict[str, Any]], case: str
) -> None:
    for rank, r in enumerate(results):
        assert r[case]["losses_switched"] == r[case]["losses_never_switched"], (rank, r[case])
        assert r[case]["after_training_equal"], (rank, r[case])


def test_meshes_differing_only_in_dimension_names_still_cross_load(
    results: list[dict[str, Any]],
) -> None:
    # torch's mesh named ("dp",), cadence's unnamed: rewrapped on load and at opt.step.
    for rank, r in enumerate(results):
        named = r["named_torch_mesh"]
        assert named["model_equal"] and named["optim_equal"], (rank, named)
        assert named["losses_switched"] == named["losses_never_switched"], (rank, named)


@pytest.mark.parametrize("what", ["model", "optim_step"])
def test_mismatched_layout_raises_naming_the_cause_and_dcp(
    results: list[dict[str, Any]], what: str
) -> None:
    # A world-2 torch file into a cadence model sharded over one rank per group.
    for rank, r in enumerate(results):
        message = r["mismatched_layout"][what]
        assert message.startswith("FullyShardError"), (rank, message)
        assert "loads only into the same layout" in message, (rank, message)
        assert "ranks [0, 1]" in message and f"ranks [{rank}]" in message, (rank, message)
        assert "torch.distributed.checkpoint" in message, (rank, message)


@pytest.mark.parametrize("case", ["dcp_torch_to_cadence", "dcp_cadence_to_torch"])
def test_dcp_checkpoint_cross_loads_bitwise(results: list[dict[str, Any]], case: str) -> None:
    for rank, r in enumerate(results):
        assert r[case] == {"model_equal": True, "optim_equal": True, "losses_equal": True}, (
            rank,
            r[case],
        )
