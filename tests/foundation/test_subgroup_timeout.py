"""Every group cadence makes waits as long as the world, not torch's 30 minutes.

Specification ([Note: subgroups wait as long as the world] in ``topology.py``): with
`cadence.init(topology, timeout=3)` on four ranks (HSDP: 2 replicas x 2 shards), a
collective on a shard group whose peer never comes times out within a few seconds, as
one on the world does, and every axis's group carries the world's timeout.
(``tests/pipeline/runtime/test_groups.py`` checks the same of the channel groups a
pipeline derives from its schedule; the tied-weight groups and the checkpointer's own
group take theirs from the same `subgroup_timeout`.)
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from cadence.launch import launch

TIMEOUT_S = 3.0
SILENT_S = 8.0  # how long the silent rank stays away: well above the timeout


def _body() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import cadence
    from cadence.topology import subgroup_timeout

    torch.set_num_threads(1)
    pg = cadence.init(cadence.Topology(dp_replicate=2, dp_shard=2), timeout=TIMEOUT_S)
    rank = dist.get_rank()
    made = {
        name: subgroup_timeout(getattr(pg, name)) for name in ("dp_shard", "dp_replicate", "dp")
    }
    out: dict[str, Any] = {"rank": rank, "made": made, "world": subgroup_timeout()}
    if rank == 3:
        time.sleep(SILENT_S)  # never joins its shard group's all-reduce
        return out
    try:
        if rank == 2:  # rank 3's shard peer: waits for it
            dist.all_reduce(torch.ones(4), group=pg.dp_shard)
        out["raised"] = None
    except RuntimeError as exc:  # torch's DistBackendError
        out["raised"] = str(exc).splitlines()[0]
    return out


def test_a_shard_group_times_out_with_the_world() -> None:
    results = launch(_body, nprocs=4, timeout=120, init_process_group=False)
    want = timedelta(seconds=TIMEOUT_S)
    for r in results:
        assert r["world"] == want, r
        assert r["made"] == {"dp_shard": want, "dp_replicate": want, "dp": want}, r
    blocked = results[2]
    assert blocked["raised"] is not None, "rank 2's all-reduce without its peer did not fail"
    # A timeout, not the peer's exit: under torch's default of 30 minutes rank 2 would
    # still be waiting when rank 3 leaves, and gloo would report the closed connection.
    raised = blocked["raised"].lower()
    assert "timed out" in raised or "timeout" in raised, blocked
