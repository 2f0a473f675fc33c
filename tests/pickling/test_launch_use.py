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

    step = make(20)
    # One launch (each rank imports torch, which is the slow part): a lambda closing over
    # a local and a closure from a factory, both defined in this test module.
    got = launch(lambda: (k + 1, step()), nprocs=1, init_process_group=False, timeout=120)
    assert got == [(6, 45)]
