"""Rank bodies for the topology: its groups, and what ``group=`` means to the wrappers.

In `group_meaning`, each (wrapper, form) sub-case trains one step on a tiny MLP and returns the largest
gradient difference against single-process training on the batches of exactly the
ranks the wrapper reduced over, with the collectives it issued. A wrong group shows
up as a wrong average, a wrong count or wrong placements.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import cadence
from cadence._groups.dp_layout import DataParallelLayout
from cadence.testing import max_abs_diff, run_subtests

__all__ = ["FORMS", "WRAPPERS", "group_meaning", "topology_groups"]

WRAPPERS = ["dp", "fsdp"]
FORMS = ["none", "process_group", "parallel_groups", "mesh_1d", "mesh_2d"]
_ROWS = 2  # rows of the global batch per rank


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(_ROWS, 8, generator=g), torch.randn(_ROWS, 1, generator=g)


def _reference_grads(model: nn.Module, ranks: list[int]) -> dict[str, torch.Tensor]:
    """Single-process gradients on the concatenated batches of ``ranks``."""
    xs, ys = zip(*(_batch(r) for r in ranks))
    F.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _group_of(form: str, pg: cadence.ParallelGroups, meshes: dict[str, Any]) -> Any:
    return {
        "none": None,
        # A flat group smaller than the world: only its two ranks average.
        "process_group": pg.dp_shard,
        "parallel_groups": pg,
        "mesh_1d": meshes["1d"],
        "mesh_2d": meshes["2d"],
    }[form]


def _case(
    wrapper: str, form: str, pg: cadence.ParallelGroups, meshes: dict[str, Any]
) -> dict[str, Any]:
    group = _group_of(form, pg, meshes)
    layout = DataParallelLayout.of(group)
    # The ranks whose batches the wrapper averages: the whole (replicate x shard) mesh.
    members = sorted(layout.mesh.mesh.flatten().tolist())
    model = _mlp()
    ref = copy.deepcopy(model)
    model_copy = copy.deepcopy(model)
    log = cadence.EventLog()
    if wrapper == "dp":
        wrapped: Any = cadence.DataParallel(model, group=group, event_log=log)
    else:
        cadence.fully_shard(model[0], group=group, event_log=log)
        wrapped = cadence.fully_shard(model, group=group, event_log=log)
    log.clear()
    x, y = _batch(dist.get_rank())
    F.mse_loss(wrapped(x), y).backward()
    grads = {}
    for name, p in wrapped.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name.removeprefix("module.")] = g
    # The control: averaging over the other membership (this rank's shard pair instead
    # of the whole world, or the reverse) must give visibly different gradients.
    other = pg.dp_ranks if len(members) < pg.dp_size else dist.get_process_group_ranks(pg.dp_shard)
    first = next(wrapped.parameters())
    return {
        "grad_diff": max_abs_diff(grads, _reference_grads(ref, members)),
        "control_diff": max_abs_diff(grads, _reference_grads(model_copy, other)),
        "members": len(members),
        "counts": log.counts(),
        "placements": str(first.placements) if isinstance(first, DTensor) else None,
    }


def group_meaning(pg: cadence.ParallelGroups) -> dict[str, Any]:
    """Every (wrapper, form) pair at world 4 with ``pg`` = Topology(dp_replicate=2, dp_shard=2)."""
    meshes = {
        "1d": init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)),
        "2d": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard")),
    }
    out: dict[str, Any] = run_subtests(
        {"wrapper": WRAPPERS, "form": FORMS}, _case, pg=pg, meshes=meshes
    )
    # Refused forms: a 3-D mesh (with a trivial dim, so world 4 can build it).
    cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "r", "s"))
    for wrapper, make in (
        ("dp", lambda: cadence.DataParallel(_mlp(), group=cube)),
        ("fsdp", lambda: cadence.fully_shard(_mlp(), group=cube)),
    ):
        try:
            make()
            out[f"refuse_3d_{wrapper}"] = "no error"
        except cadence.CadenceError as exc:
            out[f"refuse_3d_{wrapper}"] = f"{type(exc).__name__}: {exc}"
    return out


def topology_groups(pg: cadence.ParallelGroups) -> dict[str, Any]:
    """Each named group holds the ranks the layout says (an all-reduce of the ranks)."""
    out: dict[str, Any] = {"coords": tuple(pg.coords)}
    for name in ("dp", "dp_replicate", "dp_shard", "pp"):
        group = getattr(pg, name)
        t = torch.tensor([float(pg.rank)])
        dist.all_reduce(t, group=group)
        out[name] = (dist.get_world_size(group), float(t))
    return out
