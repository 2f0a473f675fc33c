"""``overlap_optimizer`` on the data-parallel wrapper of pipeline stages, pp=2 x dp=2.

Specification: with each stage's optimizer overlapped on its wrapper (DataParallel:
bucket by bucket; fully_shard: unit by unit), the runtime's wait of the stage's
deferred reduction (WAIT_REDUCE_GRAD, or the end of the step) steps the stage, so
every parameter has changed when ``rt.step`` returns, before ``opt.step()``; and after
two steps the parameters, the optimizer state and the losses are bitwise those of the
plain loop (``opt.step()`` after ``rt.step``), one stage per rank (1F1B) and two
(interleaved). What `cadence bench step`'s ``pipeline`` case relies on.
"""

from __future__ import annotations

import pytest

from cadence.testing import run_distributed
from tests.pipeline.runtime.bodies_overlap_optimizer import body

GRID = {"wrapper": ["data_parallel", "fully_shard"], "schedule": [("1f1b", 1), ("interleaved", 2)]}


@pytest.mark.slow
def test_stages_step_at_their_reduction_wait_bitwise_the_plain_loop() -> None:
    results = run_distributed(body, GRID, world_size=4, timeout=300)
    problems = []
    for rank, res in enumerate(results):
        assert len(res) == 4, res.keys()
        for case, r in res.items():
            where = f"rank {rank} {case}"
            if not (r["n_params"] and r["params_equal"] and r["state_equal"]):
                problems.append(
                    f"{where}: parameters or optimizer state differ from the plain loop"
                )
            if not r["losses_equal"]:
                problems.append(f"{where}: losses differ from the plain loop")
            if r["overlap_stepped_in_runtime"] != [True, True]:
                problems.append(f"{where}: a stage was not stepped at its reduction's wait")
            if r["plain_stepped_in_runtime"] != [False, False]:
                problems.append(f"{where}: the plain loop changed parameters inside rt.step")
    assert not problems, "\n".join(problems)
