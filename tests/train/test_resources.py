"""Resources a run holds are released on every path, an error in a step included.

Specification: when a step raises while an asynchronous checkpoint is being written,
every rank waits for that save (so the checkpoint commits whole: no ``.step-*.tmp``
folder is left), closes its saver and destroys the saver's own gloo group, and keeps
no thread of the run alive; the error reaches the caller.
"""

from __future__ import annotations

from pathlib import Path

from cadence.testing import run_distributed
from tests.train.bodies_resources import body_a_failing_step


def test_a_failing_step_leaves_nothing_behind(tmp_path: Path) -> None:
    results = run_distributed(body_a_failing_step, str(tmp_path), world_size=2, timeout=150)
    for rank, r in enumerate(results):
        assert r["closed"] == [True], f"rank {rank}: saver closed {r['closed']}"
        assert r["groups_freed"] == [True], f"rank {rank}: the save's group was not destroyed"
        assert r["folders"] == ["step-2"], f"rank {rank}: checkpoints {r['folders']}"
        assert not r["new_threads"], f"rank {rank}: threads left {r['new_threads']}"
