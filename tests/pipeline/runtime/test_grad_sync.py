"""pp=2 x dp=2 at world 4: data-parallel stages inside a pipeline, every schedule.

Specification, for `fully_shard` and `DataParallel` stages alike (the runtime uses
only their public timing verbs), under every schedule, fused (B) and split (I/W)
backwards alike: an accumulation step (``sync_gradients=False``) issues no
reduction; the syncing step issues one reduction per stage (per fully_shard unit),
each issued at REDUCE_GRAD after the stage's own last backward, the first one
before the other local stage's last backward has finished, waited before the step
returns, never more than K outstanding (K = 1 by default, and 2); gradients and losses equal one process
on both global batches (1e-5 relative). The same at pp=2 x HSDP, and for torch's own
lowered lists with deferred reduction waits (torch >= 2.15), which run as torch wrote
them.
"""

from __future__ import annotations

import pytest

from cadence.pipeline.schedule import ActionKind, parse_action
from cadence.testing import max_abs_diff, run_distributed
from tests.pipeline.runtime.bodies_grad_sync import (
    M,
    body_placement,
    body_pp2_dp2,
    body_pp2_dp2_torch_lists,
    body_pp2_hsdp,
)
from tests.pipeline.runtime.bodies_parity import SCHEDULES
from tests.pipeline.schedule.test_torch_interop import _torch_rows, needs_torch_reduce_wait

TOL = 1e-5
WRAPPERS = ["fully_shard", "data_parallel"]


def _check(results: list[dict], n_cases: int, k: int = 1) -> None:
    problems = []
    for rank, res in enumerate(results):
        assert len(res) == n_cases, res.keys()
        for case, r in res.items():
            where = f"rank {rank} {case}"
            if r["n_grads"] == 0 or not r["grad_rel_diff"] <= TOL:
                problems.append(f"{where}: grad diff {r['grad_rel_diff']:.2e} ({r['n_grads']})")
            if r.get("loss_diff", 0.0) > TOL:
                problems.append(f"{where}: loss diff {r['loss_diff']:.2e}")
            if r["reductions_after_accumulation_step"] != 0:
                problems.append(f"{where}: the accumulation step reduced")
            n_stages = len(r["history"])
            if r["reductions_per_step"] != n_stages:  # one unit / one bucket per stage
                problems.append(f"{where}: {r['reductions_per_step']} reductions")
            if not r["all_waited"] or not r["waited_in_step"]:
                problems.append(f"{where}: a reduction was not waited in the step")
            if not r["issued_after_own_backward"]:
                problems.append(f"{where}: a reduction issued before its stage's last backward")
            if n_stages > 1 and not r["overlaps_other_stage"]:
                problems.append(f"{where}: no reduction overlapped the other stage's backward")
            if r["peak_outstanding"] != min(k, n_stages):
                problems.append(f"{where}: {r['peak_outstanding']} reductions outstanding")
            for s, h in r["history"].items():
                if h[-2:] != ["reduce", "wait"]:
                    problems.append(f"{where}: stage {s} history {h}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_pp2_dp2_every_schedule_both_wrappers():
    grid = {"wrapper": WRAPPERS, "schedule": SCHEDULES}
    # K = 2: both local stages' reductions in flight at once (two-stage schedules)
    k_grid = {"wrapper": WRAPPERS, "schedule": [("interleaved", 2), ("zbv", 2)], "k": [2]}
    results = run_distributed(body_pp2_dp2, grid, k_grid, world_size=4, timeout=300)
    _check([r["k1"] for r in results], len(WRAPPERS) * len(SCHEDULES))
    _check([r["k"] for r in results], 4, k=2)


@pytest.mark.slow
def test_pp2_hsdp_split_backward_schedules():
    split = [s for s in SCHEDULES if s[0] in ("zb_h1", "zbv", "dualpipev")]
    grid = {"wrapper": ["fully_shard"], "schedule": split}
    results = run_distributed(body_pp2_hsdp, grid, world_size=4, timeout=200)
    _check(results, len(split))


# torch's lowered multi-stage schedules with two stages per rank (the ones with
# another local stage for a reduction to overlap).
TORCH_LISTS = [("interleaved", 2), ("zbv", 2), ("dualpipev", 2)]


@pytest.mark.slow
@needs_torch_reduce_wait
def test_pp2_dp2_torch_deferred_reduction_waits_both_wrappers():
    """torch's own lowered lists, built with ``defer_reduce_grad_wait=True`` (each
    WAIT_REDUCE_GRAD just before the rank's next REDUCE_GRAD or at the end of its
    list), run through cadence's runtime at pp 2 x dp 2 with both wrappers: the
    runtime holds torch's list action for action and runs torch's computes, issues
    and waits in torch's order; everything `_check` asks of cadence's own lists
    holds (parity with one process, one reduction in flight, the first issued
    before the other local stage's last backward), and the first reduction is still
    in flight when that backward ends. See [Note: torch's reduction waits] in
    ``schedule/passes.py``."""
    rows = {
        name: _torch_rows(name, 2, M, v, defer_reduce_grad_wait=True) for name, v in TORCH_LISTS
    }
    for name, per_rank in rows.items():
        for r, row in enumerate(per_rank):
            # torch really deferred: compute runs between the first issue and its
            # wait (torch's default puts the wait right after its REDUCE_GRAD).
            acts = [parse_action(a) for a in row]
            issue = next(i for i, a in enumerate(acts) if a.kind is ActionKind.REDUCE_GRAD)
            wait = next(i for i, a in enumerate(acts) if a.kind is ActionKind.WAIT_REDUCE_GRAD)
            assert any(a.is_compute for a in acts[issue:wait]), (name, r, row)
    grid = {"wrapper": WRAPPERS, "schedule": TORCH_LISTS}
    results = run_distributed(body_pp2_dp2_torch_lists, grid, rows, world_size=4, timeout=300)
    _check(results, len(WRAPPERS) * len(TORCH_LISTS))
    for rank, res in enumerate(results):
        for case, r in res.items():
            where = f"rank {rank} {case}"
            assert r["runtime_list"] == r["torch_list"], where
            assert r["executed"] == r["torch_order"], where
            assert r["in_flight_over_other_stage"], where


@pytest.mark.slow
def test_unshard_reshard_actions_gather_once_per_step():
    """UNSHARD/RESHARD in the schedule (hand-inserted at the start and end of each
    rank's list) replace on-demand gathering: one all-gather per stage per step
    instead of one per forward, parameters kept unsharded through the last B or W
    (split backwards included) and freed at RESHARD; gradients unchanged. The same
    placed by ``build_pipeline(unshard_lookahead=1)`` for stages of nested units (as
    ``cadence train --fsdp`` wraps them). In the same launch: fully_shard stages with
    a weight tied across stages."""
    tied = [("1f1b", 1), ("zbv", 2)]
    lowered = {"name_v": [("1f1b", 1), ("zbv", 2)], "lookahead": [None, 1]}
    results = run_distributed(
        body_placement, ["1f1b", "zb_h1"], tied, lowered, world_size=4, timeout=200
    )
    for rank, res in enumerate(results):
        rows = res["lowered"]
        for name_v in lowered["name_v"]:
            on_demand = rows[f"name_v={name_v},lookahead=None"]
            placed = rows[f"name_v={name_v},lookahead=1"]
            where = (rank, name_v)
            # placed by build_pipeline(unshard_lookahead=1): one all-gather per
            # fully_shard unit that owns parameters (each block, the stage's rest) per
            # step; on demand, one
            # per forward and backward of each microbatch
            assert placed["unshard_actions"] == name_v[1], where  # one per local stage
            assert placed["all_gathers"] == placed["units"] > 0, (where, placed)
            assert on_demand["unshard_actions"] == 0, where
            # (m = 4: at least one per microbatch and unit)
            assert on_demand["all_gathers"] >= 4 * placed["all_gathers"], (where, on_demand)
            assert placed["unsharded_bytes_after"] == 0, where
            assert placed["grad_rel_diff"] <= 1e-5 and on_demand["grad_rel_diff"] <= 1e-5
            assert max_abs_diff(placed["grads"], on_demand["grads"]) <= 1e-6, where
        for case, r in res["tied"].items():  # see test_boundaries.py, here sharded
            assert r["grad_diff"] <= 1e-6 and r["tie_vs_ref"] <= 1e-6, (rank, case, r)
        for case, r in res["placed"].items():
            assert r["on_demand_all_gathers"] == 4, (rank, case, r)  # one per forward (m=4)
            assert r["placed_all_gathers"] == 1, (rank, case, r)
            assert r["placed_unsharded_bytes_after"] == 0, (rank, case, r)
            assert r["placed_grad_diff"] <= 1e-6 and r["on_demand_grad_diff"] <= 1e-6, r
