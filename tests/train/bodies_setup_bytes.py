"""Rank bodies of the setup and teardown byte counts (one launch per world size)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import cadence
from cadence import EventLog
from cadence.comm import Comm
from cadence.data_parallel import DataParallel
from cadence.fsdp import fully_shard
from cadence.pipeline.runtime import build_pipeline
from cadence.precompiling._api import _agree
from cadence.precompiling._key import Key
from cadence.precompiling._share import Channel
from cadence.train.run import _to_rank0

OBJECT_KINDS = ("all_gather_object", "broadcast_object")
# A fixed report, so that its size is the same on every rank at every world size.
REPORT = {"source": "compiled", "compile_s": 1.5, "events": [["all_reduce", "dp", 0.25]] * 8}


def _account(log: EventLog) -> dict[str, Any]:
    """Bytes this rank's collectives moved (each event's buffer), by kind."""
    events = log.collectives()
    return {
        "bytes": sum(e.nbytes for e in events),
        "kinds": sorted({e.kind for e in events}),
        "objects": sum(1 for e in events if e.kind in OBJECT_KINDS),
    }


def _loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


def body_setup_bytes() -> dict[str, Any]:
    """Each setup step with its own `EventLog`, then the end-of-run report."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    pg = cadence.init(cadence.Topology(dp_replicate=world // 2, pp=2))
    torch.manual_seed(0)
    out: dict[str, Any] = {}

    log = EventLog()
    build_pipeline(
        "gpipe",
        [nn.Linear(4, 4), nn.Linear(4, 4)],
        n_microbatches=2,
        groups=pg,
        loss_fn=_loss,
        event_log=log,
    )
    out["pipeline"] = _account(log)

    log = EventLog()
    fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), event_log=log)
    out["fully_shard"] = _account(log)

    log = EventLog()
    key = Key({"function": "step", "specs": [[8, 4], "float32"]}, name="step")
    all_hit = _agree(Channel(dist.group.WORLD, 0, log), key, True, None, True)
    out["precompile"] = {**_account(log), "all_hit": all_hit}

    log = EventLog()
    DataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), event_log=log)
    out["data_parallel"] = _account(log)

    log = EventLog()
    got = _to_rank0(Comm(None, event_log=log, name="report"), REPORT)
    out["report"] = {**_account(log), "got": got}

    # The helpers themselves: a difference seen everywhere, payloads of any length.
    comm = Comm(None)
    vote = comm.agree(b"odd" if rank == world - 1 else b"even", flags=(rank == 1, False))
    out["agree"] = [vote.same, list(vote.raised)]
    out["gather_bytes"] = comm.gather_bytes(b"x" * rank)
    out["all_gather_bytes"] = comm.all_gather_bytes(b"y" * (world - rank))
    return out
