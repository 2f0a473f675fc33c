"""Scenarios for the two overlap patterns; the models come from ``examples/``.

Module level, so `run_distributed` ships them by reference. The example modules
are imported from their folder (it is not a package), which every rank can do
because the launcher forwards ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cadence.testing import max_abs_diff, named_grads, named_params
from tests._scenarios import cases, scenarios
from tests.data_parallel.common import strip

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import optimizer_in_backward as ex_b
import overlap_sparse as ex_a

STEPS = 3


def _dense_grad(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else (t.to_dense() if t.is_sparse else t)


def _pattern_a(exchange: str = "rows") -> dict[str, Any]:
    """Pattern (a) for STEPS steps: event order per step, grads and params against the oracle."""
    world = dist.get_world_size()
    tr = ex_a.Trainer(exchange=exchange)
    bag_ref, mlp_ref, opts_ref = ex_a.reference_models()
    out: dict[str, Any] = {"buckets": tr.dp.num_buckets, "order": [], "grad": 0.0}
    for step in range(STEPS):
        tr.log.clear()
        tr.step_overlapped(step)  # the example's own step
        # SGD does not touch .grad: these are the gradients the steps used.
        sparse_grad = _dense_grad(tr.bag.weight.grad)
        dense_grads = strip(named_grads(tr.dp))

        start, end = tr.log.marks("sparse_start")[0], tr.log.marks("sparse_end")[0]
        dense = tr.log.collectives("all_reduce", group="dp")
        out["order"].append(
            {
                "issued": len(dense),
                "issued_before_start": sum(e.issue_t < start.issue_t for e in dense),
                "seq_before_start": sum(e.seq < start.seq for e in dense),
                "waited_after_end": sum(
                    e.wait_end_t is not None and e.wait_end_t > end.issue_t for e in dense
                ),
            }
        )

        ex_a.reference_step(bag_ref, mlp_ref, opts_ref, step, world)
        grad_diff = max(
            max_abs_diff(dense_grads, named_grads(mlp_ref)),
            max_abs_diff(sparse_grad, _dense_grad(bag_ref.weight.grad)),
        )
        out["grad"] = max(out["grad"], grad_diff)
    out["param"] = max(
        max_abs_diff(strip(named_params(tr.dp)), named_params(mlp_ref)),
        max_abs_diff(tr.bag.weight.detach(), bag_ref.weight.detach()),
    )
    return out


def a_dense_all_reduce_in_flight_across_the_sparse_work() -> None:
    r = _pattern_a()
    n = r["buckets"]
    assert n >= 2, "the example should have several buckets"
    for step, o in enumerate(r["order"]):
        # Backward issued every bucket (by log order and clock) before the sparse
        # work began; finalize issued none.
        assert o["issued"] == n, f"step {step}: {o}, {n} buckets"
        assert o["issued_before_start"] == n, f"step {step}: {o}, {n} buckets"
        assert o["seq_before_start"] == n, f"step {step}: {o}, {n} buckets"
        # And none was waited before the sparse work had finished.
        assert o["waited_after_end"] == n, f"step {step}: {o}, {n} buckets"


def a_matches_single_process_reference(exchange: str) -> None:
    """Either way of averaging the embedding's gradient (its rows all-reduced, or its
    lookups gathered by EmbeddingExchange) trains as one process does; with lookups,
    the dense buckets still fly across the sparse work."""
    r = _pattern_a(exchange)
    assert r["grad"] < 1e-6, f"grads differ by {r['grad']:.3e}"
    assert r["param"] < 1e-6, f"params differ by {r['param']:.3e}"
    n = r["buckets"]
    assert all(o["waited_after_end"] == n for o in r["order"]), r["order"]


def a_auto_mode_waits_before_the_sparse_work() -> None:
    """Auto mode, same step: the dense all-reduces are already waited when backward returns.

    The contrast that motivates manual mode.
    """
    tr = ex_a.Trainer()
    tr.dp.require_manual_backward_finalization = False
    ids, x, y = tr.local_batch(0)
    F.mse_loss(ex_a.forward(tr.bag, tr.dp, ids, x), y).backward()
    tr.log.mark("sparse_start")
    dense = tr.log.collectives("all_reduce", group="dp")
    start = tr.log.marks("sparse_start")[0]
    waited = sum(e.wait_end_t is not None and e.wait_end_t < start.issue_t for e in dense)
    assert waited == len(dense) > 0, f"{waited} of {len(dense)} waited before the sparse work"


def _pattern_b() -> dict[str, Any]:
    """Pattern (b): finalize + dense step from a backward hook; params against the oracle."""
    world = dist.get_world_size()
    tr = ex_b.InBackwardTrainer()
    bag_ref, mlp_ref, opts_ref = ex_a.reference_models()
    for step in range(STEPS):
        tr.log.clear()
        tr.step_in_backward(step)
        ex_a.reference_step(bag_ref, mlp_ref, opts_ref, step, world)
    marks = [m.group for m in tr.log.marks()]
    return {
        "buckets": tr.dp.num_buckets,
        "records": tr.hook_records,
        # Within the last step: the dense step mark precedes the end of backward.
        "mark_order": marks,
        "param": max(
            max_abs_diff(strip(named_params(tr.dp)), named_params(mlp_ref)),
            max_abs_diff(tr.bag.weight.detach(), bag_ref.weight.detach()),
        ),
        "state_after": tr.dp.state.value,
    }


def b_finalize_and_step_run_inside_backward() -> None:
    r = _pattern_b()
    records = r["records"]
    assert len(records) == STEPS, records
    assert all(rec["in_backward"] and rec["stepped"] for rec in records), records
    # Last step's marks: the dense step happened before backward returned.
    assert r["mark_order"] == ["dense_step_in_backward", "backward_end"], r["mark_order"]
    assert r["state_after"] == "idle", r["state_after"]


def b_matches_single_process_reference() -> None:
    r = _pattern_b()
    assert r["param"] < 1e-6, f"params differ by {r['param']:.3e}"


def b_hook_before_every_bucket_launched_raises() -> None:
    """A hook between two wrapped layers runs before every bucket launched: it must raise."""
    tr = ex_b.InBackwardTrainer()
    caught: list[str] = []

    def too_early(grad: torch.Tensor) -> None:
        try:
            tr.dp.finalize_backward()
        except RuntimeError as exc:
            caught.append(str(exc))
        else:
            caught.append("no error")

    # The output of the second Linear: its backward runs before the first layer's grads exist.
    def attach(_m: Any, _i: Any, o: torch.Tensor) -> None:
        o.register_hook(too_early)  # returns None: the forward output stays unchanged

    tr.dp.module[2].register_forward_hook(attach)
    ids, x, y = tr.local_batch(0)
    F.mse_loss(ex_a.forward(tr.bag, tr.dp, ids, x), y).backward()
    tr.dp.finalize_backward()  # after backward it is fine, and leaves nothing pending
    n = tr.dp.num_buckets
    assert len(caught) == 1, caught
    assert "buckets have launched" in caught[0], caught[0]
    assert f"of {n} buckets" in caught[0] and f"{n} of {n}" not in caught[0], (n, caught[0])
    assert not tr.dp.pending, "finalize_backward() after backward left work pending"


SCENARIOS = [
    *scenarios(
        a_dense_all_reduce_in_flight_across_the_sparse_work,
        a_auto_mode_waits_before_the_sparse_work,
    ),
    *cases(a_matches_single_process_reference, "exchange", ["rows", "lookups"]),
    *scenarios(
        b_finalize_and_step_run_inside_backward,
        b_matches_single_process_reference,
        b_hook_before_every_bucket_launched_raises,
    ),
]
