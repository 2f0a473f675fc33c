"""pp=2 x dp=2 at world 4: data-parallel stages inside a pipeline.

Specification, for `fully_shard` and `DataParallel` stages alike (the runtime uses
only their public timing verbs): an accumulation step (``sync_gradients=False``)
issues no reduction; the syncing step issues one reduction per stage, each
issued at REDUCE_GRAD and waited at WAIT_REDUCE_GRAD, the first still in flight
when the second is issued; gradients equal one process on both global batches.
A wrapped stage on a schedule that splits backward into I and W is refused on
every rank before any group exists.
"""

from __future__ import annotations

import pytest

from cadence.testing import run_distributed
from tests.pipeline.runtime.bodies_grad_sync import body_pp2_dp2

GRID = {"wrapper": ["fully_shard", "data_parallel"], "name": ["interleaved"]}


@pytest.mark.slow
def test_pp2_dp2_parity_deferred_wait_and_refusal():
    results = run_distributed(body_pp2_dp2, GRID, world_size=4, timeout=150)
    for rank, res in enumerate(results):
        assert len(res["parity"]) == 2
        for case, r in res["parity"].items():
            assert r["n_grads"] > 0, case
            assert r["grad_diff"] <= 1e-6, (rank, case, r["grad_diff"])
            assert r["all_waited"], (rank, case)
            assert r["reductions"] == len(r["history"]), (case, r)  # one per stage per step
            assert r["overlapped"], (case, r)
            assert r["reductions_after_accumulation_step"] == 0, (case, r)
            # each local stage reduced once and waited once, in that order
            for s, h in r["history"].items():
                assert h == ["reduce", "wait"], (rank, case, s, h)
        for case, msg in res["refused"].items():
            assert "pipeline setup failed" in msg, (case, msg)
            assert "splits their backward into I and W" in msg, (case, msg)
