"""Stage boundaries of several tensors, a skip connection relayed across them, and a
weight tied across stages (an embedding reused as the output head).

Specification: every stage passes ``(hidden, embedding)``; the last stage adds the
embedding back and projects with its copy of stage 0's embedding table. After one
step every gradient equals one process in which the head *is* the embedding, and
both copies hold that one gradient (the sum of their uses): through one
all-reduce when the copies are on different ranks (1F1B, interleaved) and locally
when one rank holds both (ZBV, DualPipeV place stage 0 and the last stage on rank 0).
The same under the shared channel mode, and with ``batch_p2p=True``, where each run
of consecutive sends/receives is posted as one batch per communicator: the same
ops (two per transfer), in fewer posts where a run has several (shared mode). And
ZBV with ``batch_p2p=True`` under per-direction communicators (activations and
gradients in separate batches).
"""

from __future__ import annotations

from cadence.pipeline.schedule import (
    generate,
    lower,
    verify,
)
from cadence.testing import run_distributed
from tests.pipeline.runtime.bodies_boundaries import M, body_world2
from tests.pipeline.runtime.bodies_parity import SCHEDULES

# The shared-communicator runs: every lowered schedule is safe there (the schedule
# tests check all of them); these three cover plain, split and V-shaped orders.
SHARED = [("1f1b", 1), ("zb_h1", 1), ("zbv", 2)]


def _runs(name: str, v: int, rank: int) -> int:
    """Runs of consecutive SEND/RECV on ``rank``: one batch each on one shared group."""
    acts = lower(generate(name, 2, M, v)).ranks[rank]
    comm = [a.kind.name in ("SEND", "RECV") for a in acts]
    return sum(1 for i, c in enumerate(comm) if c and (i == 0 or not comm[i - 1]))


def test_multi_tensor_boundaries_and_tied_weights_world2():
    for s in SHARED:
        verify(lower(generate(s[0], 2, M, s[1])), mode="shared")
    results = run_distributed(body_world2, SCHEDULES, SHARED, world_size=2, timeout=150)
    merged = 0  # transfers that shared a post with another, over the shared runs
    for rank, res in enumerate(results):
        assert len(res) == len(SCHEDULES) + 2 + 2 * len(SHARED) + 1
        for label, r in res.items():
            assert r["p2p_ops"] == 2 * r["transfers"] > 0, (label, r)
            if "batch=True" in label:  # one post per run per communicator, never more
                assert 0 < r["batches"] <= r["transfers"], (label, r)
                if "shared" in label:
                    name, v = next(s for s in SHARED if repr(s) in label)
                    assert r["batches"] == _runs(name, v, rank), (label, r)
                    merged += r["transfers"] - r["batches"]
            else:
                assert r["batches"] == 0, (label, r)
            assert r["grad_diff"] <= 1e-6, (rank, label, r)
            assert r["tie_vs_ref"] <= 1e-6, (rank, label, r)
            local = r["local_tie"]
            assert local == ("zbv" in label or "dualpipev" in label), (label, r)
            if rank == 0:
                assert r["n_tied_here"] == (2 if local else 1), (label, r)
    assert merged > 0, "batching merged no transfers on the shared group"
