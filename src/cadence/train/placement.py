"""Which parallel axes cross nodes: said once at the start of a multi-node run.

torchrun gives each node's workers consecutive global ranks (``rank = node *
nproc_per_node + local_rank``), and `cadence.Topology` puts the pipeline outermost and
the shard innermost. So on a multi-node job a user who reads ``--pp 2`` on two nodes
as "one stage per node", or ``--fsdp --dp-replicate 2`` as "shard inside a node,
replicate across", is right, but only when the degrees divide the node's ranks the way
they expect. This module says where each axis's groups lie, from the layout and the
node size alone (no collective), so the run's first lines show which traffic crosses
the slow link, and a shard group split across nodes (every all-gather and
reduce-scatter on that link) is warned about with the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cadence.train.config import Layout

__all__ = ["AxisPlacement", "describe_placement", "placement_of", "torchrun_placement"]

# What each axis's groups carry, for the message (the wrapper decides the replicate's).
_TRAFFIC = {
    "pp": "pipeline (activations, point to point)",
    "dp_shard": "shard (fully_shard's all-gathers and reduce-scatters)",
}


@dataclass(frozen=True)
class AxisPlacement:
    """One parallel axis of degree above 1, and whether any of its groups spans nodes."""

    axis: str
    degree: int
    crosses_nodes: bool
    traffic: str


def _coords(rank: int, dp_shard: int, dp_replicate: int) -> tuple[int, int, int]:
    # The same layout as cadence.Topology.coords (kept torch-free here: this runs before
    # the trainer imports the wrappers). tests/train/test_placement.py checks the two agree.
    return rank // (dp_shard * dp_replicate), (rank // dp_shard) % dp_replicate, rank % dp_shard


def placement_of(
    *, pp: int, dp_replicate: int, dp_shard: int, ranks_per_node: int, sharded: bool
) -> list[AxisPlacement]:
    """Each axis of degree above 1, outermost first, with whether its groups cross nodes.

    ``sharded`` says whether the data-parallel wrapper is fully_shard (its replicate axis
    is HSDP's gradient all-reduce) or DataParallel (the replicate axis is every
    data-parallel rank's all-reduce).
    """
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}")
    world = pp * dp_replicate * dp_shard
    degrees = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard}
    replicate = (
        "replicate (HSDP's gradient all-reduce)"
        if sharded
        else "data parallel (the gradient all-reduce)"
    )
    out = []
    for index, axis in enumerate(("pp", "dp_replicate", "dp_shard")):
        if degrees[axis] == 1:
            continue
        # A group of this axis: the ranks whose other coordinates are equal.
        groups: dict[tuple[int, ...], set[int]] = {}
        for rank in range(world):
            c = _coords(rank, dp_shard, dp_replicate)
            key = c[:index] + c[index + 1 :]
            groups.setdefault(key, set()).add(rank // ranks_per_node)
        crosses = any(len(nodes) > 1 for nodes in groups.values())
        traffic = _TRAFFIC.get(axis, replicate)
        out.append(AxisPlacement(axis, degrees[axis], crosses, traffic))
    return out


def describe_placement(
    placements: list[AxisPlacement], *, nodes: int, ranks_per_node: int
) -> tuple[str, str | None]:
    """One line for the log, and a warning (or None) when a shard group spans nodes."""
    across = [p.traffic for p in placements if p.crosses_nodes]
    inside = [p.traffic for p in placements if not p.crosses_nodes]
    line = (
        f"placement: {nodes} nodes of {ranks_per_node} ranks; "
        f"across nodes: {', '.join(across) or 'nothing'}; "
        f"inside a node: {', '.join(inside) or 'nothing'}"
    )
    warning = None
    for p in placements:
        if p.axis == "dp_shard" and p.crosses_nodes:
            warning = (
                f"fully_shard's shard groups ({p.degree} ranks) span nodes of "
                f"{ranks_per_node} ranks, so every all-gather and reduce-scatter crosses "
                "the link between nodes; choose --dp-replicate so that the shard degree "
                "(data-parallel ranks / --dp-replicate) divides the ranks per node"
            )
    return line, warning


def torchrun_placement(layout: Layout, environ: Mapping[str, str]) -> tuple[str, str | None] | None:
    """`describe_placement` for a torchrun job of several nodes, else None.

    torchrun's ``LOCAL_WORLD_SIZE`` is the node's ranks; a job whose world is no
    larger (one node, or `cadence.launch`) has no boundary to describe.
    """
    try:
        per_node = int(environ["LOCAL_WORLD_SIZE"])
        world = int(environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if per_node < 1 or world <= per_node or world != layout.world:
        return None
    sharded = layout.wrapper == "fully_shard"
    replicate = layout.dp_replicate if sharded else layout.dp
    shard = layout.dp // layout.dp_replicate if sharded else 1
    placements = placement_of(
        pp=layout.pp,
        dp_replicate=replicate,
        dp_shard=shard,
        ranks_per_node=per_node,
        sharded=sharded,
    )
    return describe_placement(placements, nodes=-(-world // per_node), ranks_per_node=per_node)
