"""DataParallel as rank 0 of a fake world of 64, 1024 and 8192 ranks.

Same model as the fully_shard scale tests (`tests.scale._fake_world.model`), wrapped
whole. Sizes and counts only: the fake process group moves no data.

Specification:
- every rank holds the model's parameters, its gradients (after a step) and its
  buffers: the same bytes at every world, equal to the model's;
- the reducer's buckets (its only per-parameter storage: one flat buffer per
  bucket) are the same number and the same bytes at every world: the model's
  parameter bytes, once;
- construction (the parameter vote and the initial broadcasts) and each of two
  training steps (forward with the buffer broadcast, backward with its automatic
  finalization, SGD step) run the same Python operations at every world, function
  for function (see [Note: counting Python operations]), and issue the same
  collectives with the same bytes.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.scale._fake_world import WORLDS, assert_same_operations
from tests.scale._measure import figures_by_world, model_bytes


@pytest.fixture(scope="module")
def figures() -> dict[int, dict[str, Any]]:
    return figures_by_world("data_parallel", WORLDS, timeout=120)


def test_params_grads_and_buffers_are_the_models_at_every_world(figures: dict) -> None:
    full = model_bytes()
    for world, fig in figures.items():
        assert fig["params_bytes"] == fig["params_bytes_after_step"] == full["params"], world
        assert fig["grads_bytes"] == full["params"], world
        assert fig["buffers_bytes"] == fig["buffers_bytes_after_step"] == full["buffers"], world


def test_buckets_do_not_grow_with_world(figures: dict) -> None:
    full = model_bytes()["params"]
    counts = {fig["buckets"] for fig in figures.values()}
    assert len(counts) == 1, counts
    for world, fig in figures.items():
        assert fig["bucket_bytes"] == full, world


def test_construction_runs_the_same_python_operations_at_every_world(figures: dict) -> None:
    base = figures[WORLDS[0]]
    for world, fig in figures.items():
        assert_same_operations(base["init_ops"], fig["init_ops"], world)
        assert fig["init_collectives"] == base["init_collectives"], world


def test_a_step_runs_the_same_python_operations_and_collectives_at_every_world(
    figures: dict,
) -> None:
    base = figures[WORLDS[0]]
    for world, fig in figures.items():
        for i, (ops, ref) in enumerate(zip(fig["step_ops"], base["step_ops"], strict=True)):
            assert_same_operations(ref, ops, (world, i))
        assert fig["step_collectives"] == base["step_collectives"], world
