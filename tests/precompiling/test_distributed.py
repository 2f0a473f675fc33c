"""Two ranks: one compile in total, the artifact travels, the second run hits the cache.

One body per run covers: the heartbeat protocol, a rank-mismatch refusal, a compile
failure reported on every rank, a DataParallel-wrapped model whose forward is
precompiled (parity with single-process training on the concatenated batch), and a
plain step function.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.testing import run_distributed
from tests.precompiling._bodies import two_rank_body

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_two_ranks_compile_once_then_hit_the_cache(tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    first = run_distributed(two_rank_body, cache, world_size=2, timeout=240)

    # The status broadcasts kept coming while rank 0 produced: same sequence on both.
    assert [r["heartbeat"]["data"] for r in first] == [b"payload", b"payload"]
    counts = {r["heartbeat"]["broadcasts"] for r in first}
    assert len(counts) == 1 and counts.pop() >= 5  # >= 3 heartbeats, status, payload

    for r in first:
        assert "ranks built different compile keys" in r["mismatch"]
        assert "rank 1: inputs" in r["mismatch"]
        assert r["failure"].startswith("PrecompileError")
    assert first[0]["not_a_member"] == "member"
    assert "rank 1 is not a member of the group" in first[1]["not_a_member"]
    assert "compiling data_dependent failed" in first[0]["failure"]
    assert "rank 0 of the group failed to precompile" in first[1]["failure"]

    # One compile in total per precompiled function; rank 1 received the bytes.
    assert [r["dp_compiles"] for r in first] == [1, 0]
    assert [r["dp_source"] for r in first] == ["compiled", "received"]
    assert [r["step_compiles"] for r in first] == [1, 0]
    assert [r["step_source"] for r in first] == ["compiled", "received"]
    assert first[0]["dp_broadcasts"] == first[1]["dp_broadcasts"]
    for r in first:
        assert max(r["dp_grad_diffs"]) < 1e-6, r["dp_grad_diffs"]
        assert r["dp_param_diff"] < 1e-6
        assert r["step_diff"] < 1e-6

    # The waiting rank slept: its CPU time while waiting is small next to the compile's.
    compile_cpu = first[0]["dp_timings"]["compile_cpu_s"]
    wait_cpu = first[1]["dp_timings"]["wait_cpu_s"]
    assert wait_cpu < 0.25 * compile_cpu, (wait_cpu, compile_cpu)

    second = run_distributed(two_rank_body, cache, world_size=2, timeout=240)
    for r in second:
        assert (r["dp_source"], r["step_source"]) == ("cache", "cache")
        assert (r["dp_compiles"], r["step_compiles"]) == (0, 0)
        assert r["dp_broadcasts"] == 0  # every rank hit: nothing to send
        assert max(r["dp_grad_diffs"]) < 1e-6 and r["step_diff"] < 1e-6
