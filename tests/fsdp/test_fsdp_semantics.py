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
def rank0(world2: list[dict[str, Any]]) -> dict[str, Any]:
    ranks = [rank["semantics"] for rank in world2]
    assert ranks[0].keys() == ranks[1].keys()
    return ranks[0]


# -- sharding -------------------------------------------------------------------


def test_tied_params_in_one_unit_stay_tied(rank0: dict[str, Any]) -> None:
    assert rank0["tied_same_object"] and rank0["tied_same_object_after_step"]


def test_tying_across_units_raises(rank0: dict[str, Any]) -> None:
    assert "tying across units is not supported" in rank0["err_tied_across_units"]


def test_fully_shard_twice_raises(rank0: dict[str, Any]) -> None:
    assert "already applied" in rank0["err_twice"]


def test_top_down_application_raises(rank0: dict[str, Any]) -> None:
    assert "bottom-up" in rank0["err_top_down"]


def test_mixed_dtypes_in_one_unit_raise(rank0: dict[str, Any]) -> None:
    # CadenceValueError: a ValueError and a CadenceError.
    assert rank0["err_mixed_dtypes"].startswith("CadenceValueError")
    assert "mixed dtypes" in rank0["err_mixed_dtypes"]


# -- all-gather and prefetch ------------------------------------------------------


def test_one_all_gather_per_unit_before_forward(rank0: dict[str, Any]) -> None:
    # root (kept unsharded after forward) + 3 blocks under no_grad: 4 all-gathers.
    assert rank0["forward_only_all_gathers"] == 4


def test_implicit_forward_prefetch_of_next_unit(rank0: dict[str, Any]) -> None:
    # While block 0 computes, block 1's all-gather is already in flight.
    assert rank0["implicit_forward_prefetch_state"] == "unsharding"


def test_implicit_backward_prefetch_of_previous_unit(rank0: dict[str, Any]) -> None:
    assert rank0["implicit_backward_prefetch_state"] == "unsharding"


def test_explicit_prefetch_list(rank0: dict[str, Any]) -> None:
    assert rank0["explicit_prefetch_state"] == "unsharding"
    assert rank0["explicit_prefetch_counts"] == (7, 4)  # prefetch changes timing, not counts


def test_public_unshard_async_and_reshard(rank0: dict[str, Any]) -> None:
    assert rank0["unshard_handle"] == "UnshardHandle"
    assert rank0["unshard_state_before_wait"] == "unsharding"
    assert rank0["unshard_param_after_wait"] == "Parameter"
    assert rank0["unshard_param_after_reshard"] == "DTensor"


def test_err_prefetch_list_names_non_unit(rank0: dict[str, Any]) -> None:
    assert "not a fully_shard module" in rank0["err_prefetch_not_unit"]


# -- reduce-scatter ---------------------------------------------------------------


def test_one_reduce_scatter_per_unit_bounded_in_flight(rank0: dict[str, Any]) -> None:
    assert rank0["rs_count_bound1"] == rank0["rs_count_bound2"] == 4
    assert rank0["peak_inflight_bound1"] == 1
    assert rank0["peak_inflight_bound2"] == 2


def test_reduce_scatter_is_asynchronous(rank0: dict[str, Any]) -> None:
    # Manual mode: backward issued all 4; the last (default bound 1) is still unwaited.
    assert rank0["rs_issued_in_backward"] == 4
    assert rank0["rs_unwaited_after_backward"] == 1


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
    rank0: dict[str, Any], mode: str, counts: list[Any], finalize_rs: int
) -> None:
    assert rank0[f"mode_{mode}_parity"] <= TOL
    assert rank0[f"mode_{mode}_counts"] == counts
    # Units already reduced in a syncing backward are never reduced again by finalize.
    assert rank0[f"mode_{mode}_finalize_rs"] == finalize_rs


# -- finalization follows the flags ---------------------------------------------------


def test_finalize_follows_flags_without_sync(rank0: dict[str, Any]) -> None:
    assert rank0["finalize_nosync_returns"] == "None"
    assert rank0["finalize_nosync_keeps_accum"]
    assert rank0["finalize_nosync_flag_unchanged"]


def test_reshard_after_backward_false_is_preserved(rank0: dict[str, Any]) -> None:
    assert rank0["preserved_unsharded"] == ["unsharded", "unsharded"]


def test_should_finalize_after_backward(rank0: dict[str, Any]) -> None:
    assert rank0["should_finalize"] is True


# -- handle -------------------------------------------------------------------------


def test_handle_owns_work_and_writes_grads_on_wait(rank0: dict[str, Any]) -> None:
    assert rank0["handle_type"] == "ReductionHandle"
    assert rank0["grads_before_finalize"] == 0 and rank0["grads_before_wait"] == 0
    assert rank0["inflight_before_wait"]
    assert rank0["grads_after_wait"] == 8
    assert rank0["buffers_after_wait"] == 0


def test_handle_wait_idempotent(rank0: dict[str, Any]) -> None:
    assert rank0["wait_idempotent"] == 0.0
    assert rank0["rs_after_waits"] == 4


def test_err_second_finalize_before_wait(rank0: dict[str, Any]) -> None:
    assert "wait on the previous finalize_backward() handle" in rank0["err_second_finalize"]


def test_err_forward_with_pending_handle(rank0: dict[str, Any]) -> None:
    assert rank0["err_forward_pending"].startswith("FullyShardError: forward while")
    assert rank0["after_wait_forward_ok"]


def test_err_optimizer_step_with_pending_handle(rank0: dict[str, Any]) -> None:
    assert rank0["err_step_pending_handle"].startswith("FullyShardError: optimizer.step() while")


def test_err_optimizer_step_before_manual_finalize(rank0: dict[str, Any]) -> None:
    assert "finalize_backward()" in rank0["err_step_unfinalized"]
    assert rank0["step_after_finalize_ok"]


def test_err_unshard_with_pending_handle(rank0: dict[str, Any]) -> None:
    assert rank0["err_unshard_pending"].startswith("FullyShardError: unshard() while")


def test_err_finalize_inside_backward_before_the_units_launched(rank0: dict[str, Any]) -> None:
    # A hook on the root's output runs before any unit's backward: nothing launched yet.
    # (Once every unit has launched, finalizing inside backward is allowed: see
    # tests/foundation/test_gradient_timing.py.)
    msg = rank0["err_finalize_in_backward"]
    assert msg.startswith("FullyShardError: finalize_backward() was called inside backward")
    assert "only 0 of 4 units have launched" in msg


def test_err_toggle_manual_mode_inside_backward(rank0: dict[str, Any]) -> None:
    assert "inside backward" in rank0["err_toggle_in_backward"]


def test_retry_after_cleanup_exception_completes_once(rank0: dict[str, Any]) -> None:
    assert rank0["retry_first_raised"] and not rank0["retry_done_after_failure"]
    assert rank0["retry_done"]
    assert rank0["retry_rs_growth"] == 0
    assert rank0["retry_parity"] <= TOL


def test_err_forward_after_failed_backward_then_reset(rank0: dict[str, Any]) -> None:
    assert "reset_iter_state()" in rank0["err_forward_after_failed_backward"]
    assert rank0["reset_then_step_parity"] <= TOL


# -- async finalize overlapped with user work (event log) -----------------------------


def test_async_finalize_overlaps_user_work(rank0: dict[str, Any]) -> None:
    assert rank0["overlap_rs"] == 4
    assert rank0["overlap_issued_before_work"]
    assert rank0["overlap_waited_after_work"]


# -- mixed precision ------------------------------------------------------------------


def test_mixed_precision_bf16_compute_fp32_reduce(rank0: dict[str, Any]) -> None:
    assert rank0["mp_compute_dtype"] == "torch.bfloat16"
    assert rank0["mp_output_dtype"] == "torch.bfloat16"
    assert rank0["mp_output_dtype_policy"] == "torch.float32"
    assert rank0["mp_grad_dtype"] == rank0["mp_param_dtype"] == "torch.float32"
    assert rank0["mp_parity"] <= 1e-2


def test_mixed_precision_accumulation_memory_is_reported(rank0: dict[str, Any]) -> None:
    # No-sync accumulation in fp32 keeps a padded unsharded numel x 4 bytes per unit ...
    assert rank0["mp_accum_bytes"] == rank0["mp_accum_expected_fp32"]
    # ... and accumulating in bf16 halves it.
    assert rank0["mp_accum_bytes_bf16"] * 2 == rank0["mp_accum_bytes"]


# -- memory ---------------------------------------------------------------------------


def test_memory_stats(rank0: dict[str, Any]) -> None:
    assert rank0["mem_sharded"] == rank0["mem_sharded_expected"]
    assert rank0["mem_root_bytes"] <= rank0["mem_peak_unsharded"] <= rank0["mem_peak_bound"]
    assert rank0["mem_after_step_unsharded"] == 0


# -- state dict -----------------------------------------------------------------------


def test_state_dict_sharded_and_full(rank0: dict[str, Any]) -> None:
    assert rank0["sd_keys_same"] and rank0["sd_all_dtensor"]
    assert rank0["full_sd_equal"] == 0.0
    assert rank0["load_full_equal"] == 0.0
    assert rank0["load_sharded_equal"] == 0.0
