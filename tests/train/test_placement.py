"""Where each parallel axis lies on a multi-node torchrun job (`cadence.train.placement`).

Specification: the torch-free placement agrees with `cadence.Topology`'s rank layout
for every small grid; on two nodes of two ranks, HSDP replicates across nodes and
shards inside one, a pipeline of two stages puts one stage per node, and a shard group
wider than a node is warned about with the fix; a one-node job says nothing.
"""

from __future__ import annotations

import itertools

import pytest

from cadence import Topology
from cadence.train.config import TrainConfig
from cadence.train.placement import _coords, placement_of, torchrun_placement


@pytest.mark.parametrize(
    ("pp", "rep", "shard"), list(itertools.product((1, 2, 3), (1, 2), (1, 2, 4)))
)
def test_the_layout_is_topologys(pp: int, rep: int, shard: int) -> None:
    topo = Topology(dp_replicate=rep, dp_shard=shard, pp=pp)
    for rank in range(topo.world_size):
        assert _coords(rank, shard, rep) == tuple(topo.coords(rank)), rank


def _torchrun(world: int, per_node: int) -> dict[str, str]:
    return {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_node)}


def test_hsdp_on_two_nodes_replicates_across_and_shards_inside() -> None:
    layout = TrainConfig(nproc=4, fsdp=True, dp_replicate=2).layout()
    line, warning = torchrun_placement(layout, _torchrun(4, 2)) or ("", "none")
    assert line == (
        "placement: 2 nodes of 2 ranks; across nodes: replicate (HSDP's gradient "
        "all-reduce); inside a node: shard (fully_shard's all-gathers and reduce-scatters)"
    )
    assert warning is None


def test_a_pipeline_on_two_nodes_puts_one_stage_on_each() -> None:
    layout = TrainConfig(nproc=4, pp=2).layout()
    line, warning = torchrun_placement(layout, _torchrun(4, 2)) or ("", "none")
    assert "across nodes: pipeline (activations, point to point);" in line, line
    assert line.endswith("inside a node: data parallel (the gradient all-reduce)"), line
    assert warning is None


def test_a_shard_group_wider_than_a_node_is_warned_about() -> None:
    layout = TrainConfig(nproc=4, fsdp=True).layout()  # one shard group of 4 ranks
    line, warning = torchrun_placement(layout, _torchrun(4, 2)) or ("", None)
    assert "across nodes: shard" in line, line
    assert warning is not None and "--dp-replicate" in warning, warning


def test_three_axes_on_four_nodes() -> None:
    got = placement_of(pp=2, dp_replicate=2, dp_shard=2, ranks_per_node=2, sharded=True)
    assert [(p.axis, p.crosses_nodes) for p in got] == [
        ("pp", True),
        ("dp_replicate", True),
        ("dp_shard", False),
    ]


@pytest.mark.parametrize("env", [{}, _torchrun(4, 4), {"WORLD_SIZE": "4"}])
def test_one_node_or_no_torchrun_says_nothing(env: dict[str, str]) -> None:
    assert torchrun_placement(TrainConfig(nproc=4).layout(), env) is None
