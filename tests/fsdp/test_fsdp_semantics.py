"""fully_shard semantics and misuse errors, each its own test.

Sharding, all-gather and prefetch, reduce-scatter, the accumulation modes, finalization,
the handle, mixed precision, memory accounting and state dicts; every misuse raises a
`FullyShardError` naming the fix. All checks run in one world-2 body
(``bodies_semantics.semantics_body``, launched with the other world-2 bodies); each
test asserts one entry, so a failing behaviour is named by its test.
"""

from __future__ import annotations

from typing import Any

import pytest

TOL = 1e-6


@pytest.fixture(scope="module")
def r(world2: list[dict[str, Any]]) -> dict[str, Any]:
    ranks = [rank["semantics"] for rank in world2]
    assert ranks[0].keys() == ranks[1].keys()
    return ranks[0]


# -- sharding -------------------------------------------------------------------


def test_tied_params_in_one_unit_stay_tied(r: dict[str, Any]) -> None:
    assert r["tied_same_object"] and r["tied_same_object_after_step"]


def test_tying_across_units_raises(r: dict[str, Any]) -> None:
    assert "tying across units is not supported" in r["err_tied_across_units"]


def test_fully_shard_twice_raises(r: dict[str, Any]) -> None:
    assert "already applied" in r["err_twice"]


def test_top_down_application_raises(r: dict[str, Any]) -> None:
    assert "bottom-up" in r["err_top_down"]


def test_mixed_dtypes_in_one_unit_raise(r: dict[str, Any]) -> None:
    # CadenceValueError: a ValueError and a CadenceError.
    assert r["err_mixed_dtypes"].startswith("CadenceValueError")
    assert "mixed dtypes" in r["err_mixed_dtypes"]


# -- all-gather and prefetch ------------------------------------------------------


def test_one_all_gather_per_unit_before_forward(r: dict[str, Any]) -> None:
    # root (kept unsharded after forward) + 3 blocks under no_grad: 4 all-gathers.
    assert r["forward_only_all_gathers"] == 4


def test_implicit_forward_prefetch_of_next_unit(r: dict[str, Any]) -> None:
    # While block 0 computes, block 1's all-gather is already in flight.
    assert r["implicit_forward_prefetch_state"] == "unsharding"


def test_implicit_backward_prefetch_of_previous_unit(r: dict[str, Any]) -> None:
    assert r["implicit_backward_prefetch_state"] == "unsharding"


def test_explicit_prefetch_list(r: dict[str, Any]) -> None:
    assert r["explicit_prefetch_state"] == "unsharding"
    assert r["explicit_prefetch_counts"] == (7, 4)  # prefetch changes timing, not counts


def test_public_unshard_async_and_reshard(r: dict[str, Any]) -> None:
    assert r["unshard_handle"] == "UnshardHandle"
    assert r["unshard_state_before_wait"] == "unsharding"
    assert r["unshard_param_after_wait"] == "Parameter"
    assert r["unshard_param_after_reshard"] == "DTensor"


def test_err_prefetch_list_names_non_unit(r: dict[str, Any]) -> None:
    assert "not a fully_shard module" in r["err_prefetch_not_unit"]


# -- reduce-scatter ---------------------------------------------------------------


def test_one_reduce_scatter_per_unit_bounded_in_flight(r: dict[str, Any]) -> None:
    assert r["rs_count_bound1"] == r["rs_count_bound2"] == 4
    assert r["peak_inflight_bound1"] == 1
    assert r["peak_inflight_bound2"] == 2


def test_reduce_scatter_is_asynchronous(r: dict[str, Any]) -> None:
    # Manual mode: backward issued all 4; the last (default bound 1) is still unwaited.
    assert r["rs_issued_in_backward"] == 4
    assert r["rs_unwaited_after_backward"] == 1


# -- accumulation modes (2 microbatches x 2 steps, parity to the single process) ---


@pytest.mark.parametrize(
    ("mode", "counts", "finalize_rs"),
    [
        ("every", [(7, 4)] * 4, 0),
        ("nosync", [(7, 0), (7, 4)] * 2, 0),
        ("zero1", [(7, 0), (3, 4)] * 2, 0),
        ("deferred_sync", [(7, 0)] * 4, 4),
        ("deferred_async", [(7, 0)] * 4, 4),
        ("manual_sync_last", [(7, 0), (7, 4)] * 2, 0),
        ("keep_unsharded", [(7, 0), (3, 4)] * 2, 0),
    ],
)
def test_accumulation_mode(
    r: dict[str, Any], mode: str, counts: list[Any], finalize_rs: int
) -> None:
    assert r[f"mode_{mode}_parity"] <= TOL
    assert r[f"mode_{mode}_counts"] == counts
    # Units already reduced in a syncing backward are never reduced again by finalize.
    assert r[f"mode_{mode}_finalize_rs"] == finalize_rs


# -- finalization follows the flags ---------------------------------------------------


def test_finalize_follows_flags_without_sync(r: dict[str, Any]) -> None:
    assert r["finalize_nosync_returns"] == "None"
    assert r["finalize_nosync_keeps_accum"]
    assert r["finalize_nosync_flag_unchanged"]


def test_reshard_after_backward_false_is_preserved(r: dict[str, Any]) -> None:
    assert r["preserved_unsharded"] == ["unsharded", "unsharded"]


def test_should_finalize_after_backward(r: dict[str, Any]) -> None:
    assert r["should_finalize"] is True


# -- handle -------------------------------------------------------------------------


def test_handle_owns_work_and_writes_grads_on_wait(r: dict[str, Any]) -> None:
    assert r["handle_type"] == "ReductionHandle"
    assert r["grads_before_finalize"] == 0 and r["grads_before_wait"] == 0
    assert r["inflight_before_wait"]
    assert r["grads_after_wait"] == 8
    assert r["buffers_after_wait"] == 0


def test_handle_wait_idempotent(r: dict[str, Any]) -> None:
    assert r["wait_idempotent"] == 0.0
    assert r["rs_after_waits"] == 4


def test_err_second_finalize_before_wait(r: dict[str, Any]) -> None:
    assert "wait on the previous finalize_backward() handle" in r["err_second_finalize"]


def test_err_forward_with_pending_handle(r: dict[str, Any]) -> None:
    assert r["err_forward_pending"].startswith("FullyShardError: forward while")
    assert r["after_wait_forward_ok"]


def test_err_optimizer_step_with_pending_handle(r: dict[str, Any]) -> None:
    assert r["err_step_pending_handle"].startswith("FullyShardError: optimizer.step() while")


def test_err_optimizer_step_before_manual_finalize(r: dict[str, Any]) -> None:
    assert "finalize_backward()" in r["err_step_unfinalized"]
    assert r["step_after_finalize_ok"]


def test_err_unshard_with_pending_handle(r: dict[str, Any]) -> None:
    assert r["err_unshard_pending"].startswith("FullyShardError: unshard() while")


def test_err_finalize_inside_backward_before_the_units_launched(r: dict[str, Any]) -> None:
    # A hook on the root's output runs before any unit's backward: nothing launched yet.
    # (Once every unit has launched, finalizing inside backward is allowed: see
    # tests/foundation/test_gradient_timing.py.)
    msg = r["err_finalize_in_backward"]
    assert msg.startswith("FullyShardError: finalize_backward() was called inside backward")
    assert "only 0 of 4 units have launched" in msg


def test_err_toggle_manual_mode_inside_backward(r: dict[str, Any]) -> None:
    assert "inside backward" in r["err_toggle_in_backward"]


def test_retry_after_cleanup_exception_completes_once(r: dict[str, Any]) -> None:
    assert r["retry_first_raised"] and not r["retry_done_after_failure"]
    assert r["retry_done"]
    assert r["retry_rs_growth"] == 0
    assert r["retry_parity"] <= TOL


def test_err_forward_after_failed_backward_then_reset(r: dict[str, Any]) -> None:
    assert "reset_iter_state()" in r["err_forward_after_failed_backward"]
    assert r["reset_then_step_parity"] <= TOL


# -- async finalize overlapped with user work (event log) -----------------------------


def test_async_finalize_overlaps_user_work(r: dict[str, Any]) -> None:
    assert r["overlap_rs"] == 4
    assert r["overlap_issued_before_work"]
    assert r["overlap_waited_after_work"]


# -- mixed precision ------------------------------------------------------------------


def test_mixed_precision_bf16_compute_fp32_reduce(r: dict[str, Any]) -> None:
    assert r["mp_compute_dtype"] == "torch.bfloat16"
    assert r["mp_output_dtype"] == "torch.bfloat16"
    assert r["mp_output_dtype_policy"] == "torch.float32"
    assert r["mp_grad_dtype"] == r["mp_param_dtype"] == "torch.float32"
    assert r["mp_parity"] <= 1e-2


def test_mixed_precision_accumulation_memory_is_reported(r: dict[str, Any]) -> None:
    # No-sync accumulation in fp32 keeps a padded unsharded numel x 4 bytes per unit ...
    assert r["mp_accum_bytes"] == r["mp_accum_expected_fp32"]
    # ... and accumulating in bf16 halves it.
    assert r["mp_accum_bytes_bf16"] * 2 == r["mp_accum_bytes"]


# -- memory ---------------------------------------------------------------------------


def test_memory_stats(r: dict[str, Any]) -> None:
    assert r["mem_sharded"] == r["mem_sharded_expected"]
    assert r["mem_root_bytes"] <= r["mem_peak_unsharded"] <= r["mem_peak_bound"]
    assert r["mem_after_step_unsharded"] == 0


# -- state dict -----------------------------------------------------------------------


def test_state_dict_sharded_and_full(r: dict[str, Any]) -> None:
    assert r["sd_keys_same"] and r["sd_all_dtensor"]
    assert r["full_sd_equal"] == 0.0
    assert r["load_full_equal"] == 0.0
    assert r["load_sharded_equal"] == 0.0
