"""The use cadence.launch makes of the pickler: a lambda and a closure reach a rank."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")


def test_launch_runs_a_lambda_and_a_closure():
    from cadence import launch

    k = 5

    def make(m):
        def step():
            return m * 2 + k

        return step

    assert launch(lambda: k + 1, nprocs=1, init_process_group=False, timeout=120) == [6]
    assert launch(make(20), nprocs=1, init_process_group=False, timeout=120) == [45]
