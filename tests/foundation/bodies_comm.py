"""Rank body for the collective adapter: every collective, handles and the event log."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import cadence


def collectives(world: int) -> dict[str, Any]:
    rank = dist.get_rank()
    log = cadence.EventLog()
    comm = cadence.Comm(event_log=log, name="world")
    res: dict[str, Any] = {}
    t = torch.full((4,), float(rank + 1))
    comm.all_reduce(t, op="avg")
    res["avg"] = t.tolist()
    t = torch.full((4,), float(rank + 1))
    comm.all_reduce(t, op="sum")
    res["sum"] = t.tolist()
    out = torch.empty(2 * world)
    comm.all_gather_single(out, torch.full((2,), float(rank)))
    res["all_gather"] = out.tolist()
    rs = torch.empty(2)
    comm.reduce_scatter_single(rs, torch.arange(2.0 * world), op="avg")
    res["reduce_scatter_avg"] = rs.tolist()
    b = torch.full((3,), float(rank))
    comm.broadcast(b, src=0)
    res["broadcast"] = b.tolist()
    # An async work: waited twice is fine; the handle's on_complete runs exactly once.
    calls: list[int] = []
    t = torch.ones(8)
    w = comm.all_reduce(t, op="sum", async_op=True)
    log.mark("between")
    h = cadence.ReductionHandle([w], on_complete=lambda: calls.append(1))
    h.wait()
    h.wait()
    w.wait()
    res["on_complete_calls"] = len(calls)
    res["handle_done"] = h.done and h.is_completed()
    # A failing on_complete leaves the handle incomplete; a retry completes once.
    attempts: list[int] = []

    def flaky() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("cleanup failed")

    h2 = cadence.ReductionHandle([comm.all_reduce(torch.ones(2), async_op=True)], on_complete=flaky)
    try:
        h2.wait()
    except RuntimeError:
        res["first_wait_raised"] = True
    res["done_after_failure"] = h2.done
    h2.wait()
    h2.wait()
    res["attempts"] = len(attempts)
    res["counts"] = log.counts()
    ev = log.collectives("all_reduce")[2]
    mark = log.marks("between")[0]
    res["order"] = ev.issue_t <= mark.issue_t <= ev.wait_start_t <= ev.wait_end_t
    # The async all-reduce was in flight at least from its issue to the mark.
    res["in_flight_covers_mark"] = log.in_flight_time("all_reduce") >= mark.issue_t - ev.issue_t
    res["wait_split"] = abs(
        log.wait_time() - log.wait_time("all_reduce", "all_gather", "reduce_scatter", "broadcast")
    )
    res["bytes"] = ev.nbytes
    # p2p between ranks 0 and 1
    if world >= 2 and rank < 2:
        x = torch.full((3,), float(rank))
        if rank == 0:
            comm.isend(x, 1).wait()
            y = torch.empty(3)
            comm.irecv(y, 1).wait()
        else:
            y = torch.empty(3)
            comm.irecv(y, 0).wait()
            comm.isend(x, 0).wait()
        res["p2p"] = y.tolist()
    res["objects"] = comm.all_gather_object({"r": rank})
    return res
