"""Ranks on the emulated link: a launch inside it sees the link, and the loopback
counter counts what the ranks put on the wire.

Specification: a world-2 gloo all-reduce of N float32 values started inside a shaped
link puts at least one copy of every rank's N values on the link's loopback (each
rank's contribution must reach the other) and at most a few; the ranks read the
link they run on (`cadence.link.active_link`) with the rate its self-check measured.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from cadence.link import EmulatedLink, LinkSpec
from tests.link._available import unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}")

N = 1 << 20  # float32 values: 4 MiB per rank

SCRIPT = textwrap.dedent(
    """
    import json, sys

    from cadence import launch


    def body(n):
        import torch
        import torch.distributed as dist

        from cadence.link import active_link, loopback_bytes

        t = torch.ones(n)
        dist.barrier()
        before = loopback_bytes()
        dist.all_reduce(t)
        dist.barrier()
        link = active_link()
        return {"bytes": loopback_bytes() - before, "sum": float(t[0]),
                "rate": link.spec.rate_bps, "measured": link.measured_bps}


    out = launch(body, int(sys.argv[2]), nprocs=2, backend="gloo", num_threads=1, timeout=120)
    open(sys.argv[1], "w").write(json.dumps(out))
    """
)


def test_all_reduce_bytes_are_counted_on_the_link(tmp_path: Path) -> None:
    script, out = tmp_path / "ranks.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    with EmulatedLink(LinkSpec.parse("2gbit")) as link:
        link.self_check()
        assert link.run([sys.executable, str(script), str(out), str(N)]) == 0
    ranks = json.loads(out.read_text())
    payload = 4 * N
    for rank, r in enumerate(ranks):
        assert r["sum"] == 2.0, (rank, r)
        assert r["rate"] == 2_000_000_000 and r["measured"] > 0, (rank, r)
        # Both ranks read the one shared counter: every rank's bytes, both directions.
        assert 2 * payload <= r["bytes"] <= 5 * payload, (rank, r["bytes"], payload)
