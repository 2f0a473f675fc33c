"""DataParallel accepts torch DDP's constructor and attributes, each with its effect."""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.dp.bodies_ddp_surface import ddp_surface


@pytest.fixture(scope="module")
def surface() -> list[dict[str, Any]]:
    return run_distributed(ddp_surface, world_size=2, timeout=240)


def test_require_backward_grad_sync_is_honoured(surface: list[dict[str, Any]]) -> None:
    r = surface[0]["grad_accumulation"]
    # Four micro-steps, sync only on the last: one all-reduce per bucket per step, as DDP.
    assert r["cadence_all_reduces"] == r["num_buckets"] == r["ddp_all_reduces"] == 1, r
    assert r["grad_ddp"] < 1e-6, r
    assert r["flag_reads_back"] == 1.0


@pytest.mark.parametrize("case", ["default", "explicit", "list"])
def test_bucket_caps(surface: list[dict[str, Any]], case: str) -> None:
    r = surface[0]["bucket_caps"][case]
    assert r["grad"] < 1e-6, r
    # 6 x (256 KiB weight + 1 KiB bias), packed greedily in registration order:
    # default: 1 MiB first bucket, then 25 MiB; explicit 0.6 MiB everywhere; list
    # [0.3, 1]: 0.3 MiB, then 1 MiB repeating.
    assert r["cadence"] == {"default": 2, "explicit": 3, "list": 3}[case], r
    if case == "default":
        # torch DDP (after its first-step rebuild) packs in gradient-ready order; with
        # the default caps both give the same buckets.
        assert r["cadence"] == r["ddp"], r


def test_process_group_and_device_mesh(surface: list[dict[str, Any]]) -> None:
    for r in (s["groups"] for s in surface):
        assert r["process_group_local"] < 1e-7, r  # a singleton group: local gradients
        assert r["device_mesh_vs_ddp"] < 1e-6, r
        assert r["process_group_attr"] == 1.0
        assert r["both"] == "ok", r["both"]
        assert r["group_and_pg"] == "ok", r["group_and_pg"]


@pytest.mark.parametrize(
    "case",
    [
        "cpu_device_ids",
        "two_device_ids",
        "output_device_alone",
        "dim_type",
        "static_graph_pending",
        "delay_wrong_param",
        "hook_without_delay",
        "caps_list_and_first",
        "negative_cap",
        "reduce_dtype_disagree",
        "mesh_2d",
        "none_ok",
    ],
)
def test_argument_errors(surface: list[dict[str, Any]], case: str) -> None:
    assert surface[0]["devices"][case] == "ok", surface[0]["devices"][case]


def test_buffer_sync_arguments(surface: list[dict[str, Any]]) -> None:
    r = surface[0]["buffers"]
    assert r["bb_false_init_spread"] == 1.0, r  # broadcast_buffers=False: not even at init
    assert r["fsb_false_init_spread"] == 0.0, r  # forward_sync_buffers=False: at init only
    assert r["fsb_false_forward_broadcasts"] == 0, r
    assert r["rfps_false_broadcasts"] == 0 and r["rfps_false_spread"] == 1.0, r
    assert r["rfps_true_broadcasts"] == 1 and r["rfps_true_spread"] == 0.0, r
    assert r["ddp_pattern"] == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0], r
    assert r["cadence_pattern"] == r["ddp_pattern"], r
    assert r["no_init_sync_spread"] > 0, r


def test_ddp_ignore_list(surface: list[dict[str, Any]]) -> None:
    r = surface[0]["buffers"]
    assert r["ignored_param_spread"] == 1.0, r  # not broadcast at init
    assert r["ignored_buffer_spread"] == 1.0, r
    assert r["ignored_grad_spread"] > 0, r  # not reduced
    assert r["reduced_grad_spread"] == 0.0, r


def test_delayed_all_reduce(surface: list[dict[str, Any]]) -> None:
    r = surface[0]["delayed_and_precision"]
    assert r["delayed_grad_ddp"] < 1e-6, r
    # One regular bucket plus the delayed one, launched last with exactly those params.
    assert r["delayed_buckets"] == r["delayed_all_reduces"] == 2, r
    assert r["delayed_last_numel"] == r["delayed_numel"], r


def test_ddp_mixed_precision_and_deprecated_flags(surface: list[dict[str, Any]]) -> None:
    r = surface[0]["delayed_and_precision"]
    assert r["mp_wire_dtypes"] == ["bfloat16"], r
    assert r["mp_param_dtype"] == "ok", r["mp_param_dtype"]
    assert r["check_reduction_warns"] == 1.0
    assert r["skip_needs_find_unused"] == "ok", r["skip_needs_find_unused"]


def test_torch_comm_hooks_and_toggles(surface: list[dict[str, Any]]) -> None:
    r = surface[0]["comm_hooks_and_toggles"]
    assert r["torch_hook_allreduce"] < 1e-6, r
    assert r["torch_hook_fp16"] < 1e-6, r
    assert r["set_static_graph"] < 1e-6 and r["static_graph_attr"] == 1.0, r
    assert r["fsdp_verbs_all_reduces"] == 1, r
