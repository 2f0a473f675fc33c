"""Rank bodies of the setup-vote tests (world 4: pp=2 x dp_replicate=2, one launch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import cadence
from cadence import EventLog
from cadence.pipeline.runtime import build_channel_groups, build_pipeline
from cadence.pipeline.schedule import ChannelPlan

OBJECT_KINDS = ("all_gather_object", "broadcast_object")


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


def body_setup_vote() -> dict[str, Any]:
    """Each case on every rank; the results say what each rank saw."""
    pg = cadence.init(cadence.Topology(dp_replicate=2, pp=2))
    rank = dist.get_rank()
    pp_groups = pg.topology.groups_of("pp")  # [[0, 2], [1, 3]]
    plan = ChannelPlan.build([(0, 1), (1, 0)], placement=(0, 1))
    out: dict[str, Any] = {}

    # The happy path: build_pipeline over two pp groups, recorded.
    log = EventLog()
    torch.manual_seed(0)
    build_pipeline(
        "gpipe",
        [nn.Linear(4, 4), nn.Linear(4, 4)],
        n_microbatches=2,
        groups=pg,
        loss_fn=_loss,
        event_log=log,
    )
    setup = log.collectives(group="pp-setup")
    out["happy_kinds"] = sorted({e.kind for e in setup})
    out["happy_agree_bytes"] = [e.nbytes for e in setup if e.kind == "agree"]
    out["happy_objects"] = sum(log.count(k) for k in OBJECT_KINDS)

    # Options differ: every rank names every rank's options.
    out["options"] = _error(
        lambda: build_channel_groups(
            plan, pp_ranks=pg.pp_ranks, pp_groups=pp_groups, agree=("opt", rank % 2)
        )
    )

    # Rank 0 names the pp groups wrongly (1 and 3 swapped): every rank names rank 0.
    wrong = [[0, 2], [3, 1]] if rank == 0 else pp_groups
    log = EventLog()
    out["pp_groups"] = _error(
        lambda: build_channel_groups(plan, pp_ranks=pg.pp_ranks, pp_groups=wrong, event_log=log)
    )
    out["pp_groups_details"] = log.count("all_gather")

    # Rank 3 cannot tell the pp groups (none given, its pipeline is not the world):
    # the ranks exchange their pp ranks, and every rank ends with the same groups.
    given = None if rank == 3 else pp_groups
    cg = build_channel_groups(plan, pp_ranks=pg.pp_ranks, pp_groups=given)
    out["unknown_groups"] = [list(g) for g in cg.all_pp_groups]

    # A local error on rank 2 only: every rank raises it, naming rank 2.
    out["local_error"] = _error(
        lambda: build_channel_groups(
            plan,
            pp_ranks=pg.pp_ranks,
            pp_groups=pp_groups,
            local_error="rank 2 refused" if rank == 2 else None,
        )
    )

    # Rank 1 (pp rank 1 of the pipeline {1, 3}) plans another channel set.
    other = ChannelPlan.build([(0, 1)], placement=(0, 1)) if rank == 1 else plan
    out["plans"] = _error(
        lambda: build_channel_groups(other, pp_ranks=pg.pp_ranks, pp_groups=pp_groups)
    )
    return out
