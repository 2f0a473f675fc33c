"""Stage boundaries of several tensors, a skip connection relayed across them, and a
weight tied across stages (an embedding reused as the output head).

Specification: every stage passes ``(hidden, embedding)``; the last stage adds the
embedding back and projects with its copy of stage 0's embedding table. After one
step every gradient equals one process in which the head *is* the embedding, and
both copies hold that one gradient (the sum of their uses): through one
all-reduce when the copies are on different ranks (1F1B, interleaved) and locally
when one rank holds both (ZBV, DualPipeV place stage 0 and the last stage on rank 0).
"""

from __future__ import annotations

from cadence.testing import run_distributed
from tests.pipeline.runtime.bodies_boundaries import body_world2

SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb_h1", 1), ("zbv", 2), ("dualpipev", 2)]


def test_multi_tensor_boundaries_and_tied_weights_world2():
    results = run_distributed(body_world2, SCHEDULES, world_size=2, timeout=150)
    for rank, res in enumerate(results):
        assert len(res) == len(SCHEDULES)
        for label, r in res.items():
            assert r["grad_diff"] <= 1e-6, (rank, label, r)
            assert r["tie_vs_ref"] <= 1e-6, (rank, label, r)
            local = r["local_tie"]
            assert local == ("zbv" in label or "dualpipev" in label), (label, r)
            if rank == 0:
                assert r["n_tied_here"] == (2 if local else 1), (label, r)
