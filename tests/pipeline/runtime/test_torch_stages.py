"""torch's own DDP and FSDP2 modules as pipeline stages, through `cadence.gradient_timing`."""

from __future__ import annotations

from cadence.testing import run_distributed
from tests.pipeline.runtime.bodies_torch_stages import body_torch_stages


def test_torch_wrapped_stages_match_one_process_and_split_schedules_are_refused():
    grid = {"wrapper": ["torch_ddp", "torch_fsdp2"], "name": ["gpipe", "1f1b"]}
    results = run_distributed(body_torch_stages, grid, world_size=4, timeout=200)
    for rank, r in enumerate(results):
        assert len(r["cases"]) == 4, r["cases"]
        for label, row in r["cases"].items():
            assert row["n"] > 0 and row["grad_rel_diff"] < 1e-5, (rank, label, row)
        # every rank raises the same vote error, naming the stage and the fix
        msg = r["refused"]
        assert "torch wrapper" in msg and "cadence.DataParallel" in msg, (rank, msg)
