"""The runtime at world 2: what a step does, what it refuses, and how it fails.

Specification:
- an uneven batch raises at ``step()`` on every rank, naming the fix;
- two steps without ``zero_grad`` accumulate exactly the reference's gradients
  (each step's loss is scaled once), and ``eval()`` matches the reference forward
  without touching gradients;
- every P2P op runs on the channel its plan names; the looped wrap-around is the
  channel (1 -> 0) at world 2, the V turn m LOCAL hand-offs each way on rank 1;
- a lowered schedule the simulator rejects (a FIFO swap) is refused on every rank;
- a rank given another placement's stages, or ranks whose plans differ, make every
  rank raise `PlanMismatchError` before any group exists (no hang);
- each argument the runtime cannot honour is refused with its own message;
- a failing action raises with the rank's lowered schedule and the action marked.
"""

from __future__ import annotations

import pytest

from cadence.testing import run_distributed
from tests.pipeline.runtime.bodies_channel_modes import check_mode_rows
from tests.pipeline.runtime.bodies_step import body_runtime_world2


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(body_runtime_world2, world_size=2, timeout=150)


@pytest.mark.parametrize("name", ["interleaved", "zbv"])
def test_step_accumulate_eval_and_channels(results, name: str) -> None:
    for rank, res in enumerate(results):
        out = res["behaviour"][f"name={name!r}"]
        assert "does not split into" in out["uneven"] and "multiple of" in out["uneven"], out
        assert out["uneven"].startswith("PipelineUsageError")
        assert out["accum_grad_diff"] <= 1e-6, (name, out["accum_grad_diff"])
        assert out["eval_grads_untouched"] == 0.0
        if "eval_logits_diff" in out:
            assert out["eval_logits_diff"] <= 1e-5 and out["eval_loss_diff"] <= 1e-6
        assert out["op_channel_matches"], (name, rank)
        # receive lookahead (default on per-edge channels): some early, none late
        assert out["recv_timing"]["late"] == 0 and out["recv_timing"]["early"] > 0, out
        assert set(out["recorded_channels"]) <= set(out["plan_channels"])
        if name == "interleaved":
            # looped placement at world 2: the wrap-around 1 -> 2 is channel (1 -> 0)
            assert "pp1->0" in out["recorded_channels"]
            assert out["local_pairs"] == []
        elif rank == 1:  # V turn: stage 1 -> 2 lives on rank 1, m hand-offs each way
            assert out["local_fwd"] == 4 and out["local_bwd"] == 4, out
            assert out["local_pairs"] == [(1, 2), (2, 1)]
        else:
            assert out["local_fwd"] == 0 and out["local_bwd"] == 0


def test_per_direction_groups_world2(results) -> None:
    for rank, res in enumerate(results):
        assert len(res["channel_modes"]) == 3
        problems = check_mode_rows(res["channel_modes"], [(0, 1)])
        assert not problems, (rank, problems)


def test_fifo_swap_is_refused_on_every_rank(results) -> None:
    for res in results:
        assert res["fifo_swap"].startswith("FifoMismatchError"), res["fifo_swap"]


def test_divergent_placement_fails_fast_everywhere(results) -> None:
    msgs = [res["diverge"] for res in results]
    assert all("pipeline setup failed" in m and "rank 1" in m for m in msgs), msgs
    assert all("schedule places stages [1, 3]" in m for m in msgs), msgs


def test_divergent_plans_fail_fast_everywhere(results) -> None:
    for res in results:
        msg = res["diverge_channels"]
        assert "plans differ" in msg and "rank 1 (pp ranks [0, 1])" in msg, msg
        assert "channels only on rank 0: 1->0" in msg, msg


MISUSE = {
    "no_m": "PipelineUsageError: build_pipeline(name, ...) needs n_microbatches=",
    "m_mismatch": "n_microbatches=3 but the schedule has 4 microbatches",
    "chunks_mismatch": "chunks=1 but the schedule has 2 stages per rank",
    "torch_source_schedule": "source='torch' selects torch's IR for a schedule *name*",
    "torch_source_gpipe": "torch runs it as a hand-written loop",
    "bad_source": "source='jax'; use 'cadence' or 'torch'",
    "k_zero": "max_outstanding_reductions=0; use an int >= 1",
    "k_lowered": "max_outstanding_reductions=2 places WAIT_REDUCE_GRAD while lowering",
    "lookahead_negative": "unshard_lookahead=-1; use an int >= 0",
    "lookahead_bool": "unshard_lookahead=True; use an int >= 0",
    "lookahead_lowered": "unshard_lookahead=1 places UNSHARD/RESHARD while lowering",
    "tie_one_stage": "a tie names one parameter in each of two or more different stages",
    "tie_no_param": "has no parameter 'nope'",
    "stage_count": "got 3 stage modules, the schedule has 2 stages",
    "missing_stage": "stage_modules has no module for stages",
    "bad_input_meta": "input_meta names stages [9]",
    "bad_mode": "channel_mode='ring'; use one of ('shared', 'per_direction', 'per_directed_edge')",
    "compute_only": "ScheduleValidationError: verify takes a lowered schedule",
    "wrong_pp": "the schedule has 4 pipeline ranks but the pp group has 2",
    "not_a_schedule": "PipelineRuntime takes a lowered cadence Schedule, got dict",
}


@pytest.mark.parametrize("case", sorted(MISUSE))
def test_misuse_is_refused_before_any_collective(results, case: str) -> None:
    for res in results:
        assert MISUSE[case] in res["misuse"][case], res["misuse"][case]


def test_failure_reports_the_schedule_with_the_action_marked(results) -> None:
    for res in results:
        msg, index, action = res["error_report"]
        assert index == 2 and action == "1F0"
        lines = msg.splitlines()
        assert "failed at action 2 (1F0)" in lines[0] and "StageShapeError" in lines[0]
        marked = [ln for ln in lines if "<-- ERROR HERE" in ln]
        assert len(marked) == 1 and "1F0" in marked[0]
        listed = [ln for ln in lines[2:] if ln.strip()[:1].isdigit()]
        assert len(listed) == 6
