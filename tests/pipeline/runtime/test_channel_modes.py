"""Per-direction communicators at run time: every schedule, pp 4 and pp 2 x dp 2.

Specification: under ``channel_mode="per_direction"`` each pp group gets exactly two
new communicators (activations, gradients), each over all of the pp group's ranks,
created in the same order on every rank (every rank creates every pp group's);
every SEND/RECV of a step runs on the group of its payload (event names
``pp{src}->{dst}/fwd`` or ``/bwd``, in plan order); gradients and losses equal the
per-directed-edge run and one process on the pipeline's batch. (The world-2 case
runs in test_step.py's launch.)
"""

from __future__ import annotations

import pytest

from cadence.testing import run_distributed
from tests.pipeline.runtime.bodies_channel_modes import (
    SCHEDULES,
    body_channel_modes,
    check_mode_rows,
)


@pytest.mark.slow
def test_per_direction_every_schedule_world4():
    results = run_distributed(body_channel_modes, SCHEDULES, world_size=4, timeout=200)
    problems = []
    for rank, res in enumerate(results):
        assert len(res["pp4"]) == len(res["pp2xdp2"]) == len(SCHEDULES)
        for r in res["pp4"].values():
            assert r["group_members"] == [(0, 1, 2, 3)] * 2
        for r in res["pp2xdp2"].values():
            assert r["group_members"] == [tuple(sorted(res["pp_group"]))] * 2
        problems += [f"rank {rank} pp4 {x}" for x in check_mode_rows(res["pp4"], [(0, 1, 2, 3)])]
        pp2 = check_mode_rows(res["pp2xdp2"], [(0, 2), (1, 3)])
        problems += [f"rank {rank} pp2xdp2 {x}" for x in pp2]
    assert not problems, "\n".join(problems)
