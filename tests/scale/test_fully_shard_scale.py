"""fully_shard as rank 0 of a fake world of 64, 1024 and 8192 ranks.

Model (`tests.scale._fake_world.model`): two blocks, each its own unit, whose
parameters have 2 x 8192 rows, and a BatchNorm(16) in the root unit. Sizes and counts
only: the fake process group moves no data (see `tests/scale/_fake_world.py`).

Specification:
- a rank holds exactly 1/world of each block's parameters: dim-0 chunks of
  rows / world rows, and a unit's flat shard holds nothing else;
- padding is bounded: each parameter is chunked with torch.chunk's rule, so rank 0
  (the largest chunk) holds ceil(rows / world) rows of it, at most numel / world
  plus one row; the BatchNorm's 16-row parameters stay at one row each from world
  16 on, and the total is exactly the sum of those chunks;
- after a training step the gradients are the shard's size (reduce-scattered, no
  unsharded copy kept), the parameters still are, and the gathered parameters are
  freed between steps;
- buffers are replicated: every rank holds the model's buffers, the same bytes at
  every world, never world times them;
- construction and each of two training steps (forward, backward with its automatic
  finalization, SGD step) run the same number of Python operations at every world,
  function for function (see [Note: counting Python operations]), and issue the same
  collectives; the blocks' all-gathers and reduce-scatters carry the same bytes at
  every world (the block's own), the root's carry world x its padded shard: at most
  the root's parameters plus world x one row per parameter.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.scale._fake_world import ROWS, WORLDS, assert_same_operations, model
from tests.scale._measure import figures_by_world, model_bytes

FLOAT = 4  # bytes: the model is float32


@pytest.fixture(scope="module")
def figures() -> dict[int, dict[str, Any]]:
    return figures_by_world("fully_shard", WORLDS, timeout=120)


def _shapes() -> tuple[list[Any], list[Any]]:
    net = model()
    blocks = [[p.shape for p in b.parameters()] for b in list(net)[:2]]
    root = [p.shape for p in net[2].parameters()]
    return blocks, root


def test_a_block_shard_is_exactly_one_world_th_of_the_block(figures: dict) -> None:
    blocks, _ = _shapes()
    for world, fig in figures.items():
        # Units are listed root first, then the blocks in module order.
        for shapes, got in zip(blocks, fig["shard_numel"][1:], strict=True):
            numel = sum(math.prod(s) for s in shapes)
            assert ROWS % world == 0 and got * world == numel, (world, got, numel)


def test_padding_is_at_most_one_row_per_parameter(figures: dict) -> None:
    blocks, root = _shapes()
    every = [s for shapes in blocks for s in shapes] + root
    numel = sum(math.prod(s) for s in every)
    for world, fig in figures.items():
        rank0 = sum(math.ceil(s[0] / world) * math.prod(s[1:]) for s in every)
        bound = numel / world + sum(math.prod(s[1:]) for s in every)
        assert fig["params_bytes"] == fig["flat_shard_bytes"] == FLOAT * rank0, world
        assert rank0 <= bound, (world, rank0, bound)
        assert fig["shard_numel"][0] == len(root), world  # one row of each 16-row param


def test_parameter_bytes_shrink_as_one_over_world(figures: dict) -> None:
    full = model_bytes()["params"]
    for world, fig in figures.items():
        padding = FLOAT * figures[world]["shard_numel"][0]  # the root's rows, see above
        assert fig["params_bytes"] - padding <= full / world, (world, fig["params_bytes"])
    assert figures[64]["params_bytes"] > 8 * figures[1024]["params_bytes"] > 0


def test_after_a_step_gradients_are_shard_sized_and_gathers_are_freed(figures: dict) -> None:
    for world, fig in figures.items():
        assert fig["grads_bytes"] == fig["params_bytes"], world
        assert fig["params_bytes_after_step"] == fig["params_bytes"], world
        assert fig["unsharded_bytes_at_rest"] == 0, world


def test_buffers_are_replicated_not_multiplied_by_world(figures: dict) -> None:
    buffers = model_bytes()["buffers"]
    for world, fig in figures.items():
        assert fig["buffers_bytes"] == fig["buffers_bytes_after_step"] == buffers, world


def test_construction_runs_the_same_python_operations_at_every_world(figures: dict) -> None:
    base = figures[WORLDS[0]]
    for world, fig in figures.items():
        assert_same_operations(base["init_ops"], fig["init_ops"], world)
        assert fig["init_collectives"] == base["init_collectives"], world


def test_a_step_runs_the_same_python_operations_at_every_world(figures: dict) -> None:
    base = figures[WORLDS[0]]["step_ops"]
    for world, fig in figures.items():
        for i, (ops, ref) in enumerate(zip(fig["step_ops"], base, strict=True)):
            assert_same_operations(ref, ops, (world, i))


def test_a_step_issues_the_same_collectives_and_block_bytes_stay_flat(figures: dict) -> None:
    blocks, root = _shapes()
    block_bytes = {FLOAT * sum(math.prod(s) for s in shapes) for shapes in blocks}
    root_numel = sum(math.prod(s) for s in root)
    root_rows = sum(math.prod(s[1:]) for s in root)
    base = figures[WORLDS[0]]["step_collectives"]
    for world, fig in figures.items():
        for step, ref in zip(fig["step_collectives"], base, strict=True):
            assert [k for k, _ in step] == [k for k, _ in ref], world
            for kind, nbytes in step:
                assert kind in ("all_gather", "reduce_scatter"), kind
                if nbytes in block_bytes:
                    continue  # a block's: its own bytes, at every world
                # The root's: world x its padded shard (one row of each parameter).
                assert nbytes == FLOAT * world * fig["shard_numel"][0], (world, kind, nbytes)
                assert nbytes <= FLOAT * (root_numel + world * root_rows), (world, nbytes)
