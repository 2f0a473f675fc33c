"""Rank bodies of the pp=2 x dp=2 tests: data-parallel stages inside a pipeline."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

import cadence
from cadence import EventLog
from cadence.fsdp import fully_shard
from cadence.models import GPTConfig, MarkovTokens, TinyGPT
from cadence.pipeline.runtime import build_pipeline
from cadence.pipeline.schedule import (
    Action,
    ActionKind,
    Schedule,
    complete_comms,
    parse_action,
    placement_for,
)
from cadence.testing import max_abs_diff, run_subtests

M = 4  # microbatches: DualPipeV needs m >= 2p


def _model(n: int) -> TinyGPT:
    torch.manual_seed(7)
    return TinyGPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=n))


def _wrap(chunk: torch.nn.Module, wrapper: str, pg, log: EventLog) -> torch.nn.Module:
    if wrapper == "data_parallel":
        # The same runtime drives DataParallel through the same public verbs.
        return cadence.DataParallel(chunk, group=pg, event_log=log)
    return fully_shard(chunk, group=pg, event_log=log)


def _order(log: EventLog, mine: list[int]) -> dict:
    """Event order of the syncing step: reductions against the other stage's compute."""
    events = [e for e in log.events if e.kind == "mark"]
    outstanding = peak = 0
    issued: dict[int, int] = {}
    waited: dict[int, int] = {}
    last_bwd: dict[int, int] = {}
    for e in events:
        if e.group == "pp_reduce_grad":
            issued[e.meta["stage"]] = e.seq
            outstanding += 1
            peak = max(peak, outstanding)
        elif e.group == "pp_wait_reduce_grad":
            waited[e.meta["stage"]] = e.seq
            outstanding -= 1
        elif e.group == "pp_compute" and e.meta["kind"] in ("B", "W"):
            last_bwd[e.meta["stage"]] = e.seq
    last_compute = max(e.seq for e in events if e.group == "pp_compute")
    first = min(mine, key=lambda s: issued[s])  # the stage whose gradients are final first
    others = [s for s in mine if s != first]
    return {
        "peak_outstanding": peak,
        "all_waited": sorted(waited) == sorted(mine) and outstanding == 0,
        # issued after its own last backward, before another local stage's last backward
        "issued_after_own_backward": all(issued[s] > last_bwd[s] for s in mine),
        "overlaps_other_stage": all(issued[first] < last_bwd[s] for s in others),
        # ... and still in flight when that backward ends: waited after it, not at once
        "in_flight_over_other_stage": all(waited[first] > last_bwd[s] for s in others),
        "waited_in_step": all(waited[s] > issued[s] for s in mine),
        "n_after_last_compute": sum(waited[s] > last_compute for s in mine),
    }


def _torch_schedule(name: str, v: int, rows: Sequence[Sequence[str]]) -> Schedule:
    """torch's lowered per-rank lists (its action strings), imported as
    ``build_pipeline(source="torch")`` imports them: parsed, then `complete_comms`."""
    sched = Schedule.from_lists(
        rows, placement_for(name, 2, v), generator=f"torch:{name}", v=v, m=M, lowered=True
    )
    return complete_comms(sched)


def _executed(log: EventLog) -> list[str]:
    """The step's computes, REDUCE_GRADs and WAIT_REDUCE_GRADs in the order the
    runtime ran them (event marks), as action strings."""
    out = []
    for e in log.events:
        if e.kind != "mark":
            continue
        if e.group == "pp_compute":
            out.append(f"{e.meta['stage']}{e.meta['kind']}{e.meta['mb']}")
        elif e.group == "pp_reduce_grad":
            out.append(f"{e.meta['stage']}REDUCE_GRAD")
        elif e.group == "pp_wait_reduce_grad":
            out.append(f"{e.meta['stage']}WAIT_REDUCE_GRAD")
    return out


def _skeleton(acts: Sequence[Action]) -> list[str]:
    """What `_executed` records of an action list: computes (FB_OVERLAP as its
    parts), REDUCE_GRAD and WAIT_REDUCE_GRAD, in list order."""
    keep = (ActionKind.REDUCE_GRAD, ActionKind.WAIT_REDUCE_GRAD)
    return [str(p) for a in acts for p in (a.compute_parts() or ((a,) if a.kind in keep else ()))]


def pp_dp_case(
    pg,
    wrapper: str,
    schedule: tuple[str, int],
    k: int = 1,
    torch_rows: Mapping[str, Sequence[Sequence[str]]] | None = None,
) -> dict:
    """An accumulation step, then a syncing step; gradients against one process.
    ``k``: reductions allowed in flight per rank (``max_outstanding_reductions``).
    ``torch_rows``: run torch's own lowered lists for the schedule (``{name: rows}``)
    instead of cadence's, and record what ran against torch's list."""
    name, v = schedule
    n = 2 * v
    mine = sorted(s for s, r in placement_for(name, 2, v).items() if r == pg.pp_rank)
    log = EventLog()
    chunks = _model(n).split_stages(n)
    for s in mine:
        chunks[s] = _wrap(chunks[s], wrapper, pg, log)
    # A shard group of one (HSDP over whole shards) reduces by the replicas' all-reduce
    # alone: its reduce-scatter is a local copy, no collective (as FSDP2's).
    whole = pg.topology.dp_shard == 1
    reduce_kind = "all_reduce" if wrapper == "data_parallel" or whole else "reduce_scatter"
    sched = name if torch_rows is None else _torch_schedule(name, v, torch_rows[name])
    rt = build_pipeline(
        sched,
        chunks,
        n_microbatches=M,
        chunks=v,
        groups=pg,
        loss_fn=TinyGPT.loss,
        event_log=log,
        max_outstanding_reductions=k,
    )
    data = MarkovTokens(32, 8, seed=11)
    (xa, ya), (xb, yb) = data.batch(0, 4 * M), data.batch(1, 4 * M)
    rows = pg.local_slice(xa.shape[0])
    log.clear()
    # an accumulation step (no reduction), then a syncing step: reduced once, scaled once
    rt.step(xa[rows], target=ya[rows], sync_gradients=False)
    n_reductions_after_first = log.count(reduce_kind)
    log.clear()
    losses: list = []
    rt.step(xb[rows], target=yb[rows], losses=losses)
    got = {}
    for s in mine:
        inner = chunks[s].module if wrapper == "data_parallel" else chunks[s]
        for k, p in inner.named_parameters():
            g = p.grad
            got[f"{s}.{k}"] = g.full_tensor() if hasattr(g, "full_tensor") else g
    ref = _model(n)
    ref_chunks = ref.split_stages(n)
    TinyGPT.loss(ref(xa), ya).backward()
    want = {f"{s}.{k}": p.grad for s in mine for k, p in ref_chunks[s].named_parameters()}
    scale = max(float(g.abs().max()) for g in want.values())
    with torch.no_grad():
        ref_loss = [
            float(TinyGPT.loss(ref(x), y)) for x, y in zip(xb.chunk(2 * M), yb.chunk(2 * M))
        ]
    TinyGPT.loss(ref(xb), yb).backward()
    red = log.collectives(reduce_kind)
    row = {
        "grad_rel_diff": max_abs_diff(got, want) / scale,
        "n_grads": len(got),
        "reductions_per_step": len(red),
        "reductions_after_accumulation_step": n_reductions_after_first,
        "history": {s: rt._sync[s].history for s in mine},
        "all_waited": all(e.waited for e in red),
        "all_gathers": log.count("all_gather"),
        **_order(log, mine),
    }
    if torch_rows is not None:
        theirs = torch_rows[name][pg.pp_rank]
        # The list the runtime holds, less what the import adds (LOCALs, channels,
        # sequence numbers), is torch's list action for action ...
        row["runtime_list"] = [
            str(replace(a, channel=None, seq=None))
            for a in rt.actions
            if a.kind is not ActionKind.LOCAL
        ]
        row["torch_list"] = list(theirs)
        # ... and what ran, in event order, is torch's computes, issues and waits.
        row["executed"] = _executed(log)
        row["torch_order"] = _skeleton([parse_action(a) for a in theirs])
    if losses:  # this rank's dp slice of the global batch: its microbatches' losses
        lo = rows.start // (xb.shape[0] // (2 * M))
        row["loss_diff"] = max_abs_diff([float(x) for x in losses], ref_loss[lo : lo + M])
    return row


def body_pp2_dp2(grid: dict, k_grid: dict) -> dict:
    pg = cadence.init(cadence.Topology(dp_shard=2, pp=2))
    return {"k1": run_subtests(grid, pp_dp_case, pg), "k": run_subtests(k_grid, pp_dp_case, pg)}


def body_pp2_dp2_torch_lists(grid: dict, torch_rows: dict) -> dict:
    """pp=2 x dp=2 running torch's own lowered lists (``torch_rows``: ``{name: rows}``)."""
    pg = cadence.init(cadence.Topology(dp_shard=2, pp=2))
    return run_subtests(grid, pp_dp_case, pg, torch_rows=torch_rows)


def body_pp2_hsdp(grid: dict) -> dict:
    # world 4 = pp 2 x (replicate 2 x shard 1): the HSDP path (reduce-scatter over the
    # shard group, then all-reduce over the replicas) with every shard whole.
    pg = cadence.init(cadence.Topology(dp_replicate=2, dp_shard=1, pp=2))
    return run_subtests(grid, pp_dp_case, pg)


def placed_case(pg, name: str) -> dict:
    """UNSHARD at the start of each rank's list and RESHARD at its end (hand-inserted):
    one all-gather per stage per step, against one per forward when gathered on demand."""
    from cadence.pipeline.schedule import Action, ActionKind, generate, lower

    low = lower(generate(name, 2, M, 1))
    placed = low.with_ranks(
        [
            [Action(ActionKind.UNSHARD, s) for s in low.stages_of(r)]
            + list(acts)
            + [Action(ActionKind.RESHARD, s) for s in low.stages_of(r)]
            for r, acts in enumerate(low.ranks)
        ]
    )
    out = {}
    data = MarkovTokens(32, 8, seed=11)
    (x, y) = data.batch(0, 4 * M)
    rows = pg.local_slice(x.shape[0])
    for label, sched in (("on_demand", low), ("placed", placed)):
        log = EventLog()
        chunks = _model(2).split_stages(2)
        mine = low.stages_of(pg.pp_rank)
        stages = {s: _wrap(chunks[s], "fully_shard", pg, log) for s in mine}
        rt = build_pipeline(sched, stages, groups=pg, loss_fn=TinyGPT.loss, event_log=log)
        rt.step(x[rows], target=y[rows])
        for st in stages.values():
            st.zero_grad()
        log.clear()
        rt.step(x[rows], target=y[rows])
        out[f"{label}_all_gathers"] = log.count("all_gather")
        got = {
            f"{s}.{k}": p.grad.full_tensor() for s in mine for k, p in stages[s].named_parameters()
        }
        ref_chunks = _model(2).split_stages(2)
        TinyGPT.loss(torch.nn.Sequential(*ref_chunks)(x), y).backward()
        want = {f"{s}.{k}": p.grad for s in mine for k, p in ref_chunks[s].named_parameters()}
        out[f"{label}_grad_diff"] = max_abs_diff(got, want)
        out[f"{label}_unsharded_bytes_after"] = sum(
            st.memory_stats()["unsharded_param_bytes"] for st in stages.values()
        )
    return out


def body_placement(names: list[str], tied: list[tuple[str, int]], lowered: dict) -> dict:
    from tests.pipeline.runtime.bodies_boundaries import case
    from tests.pipeline.runtime.bodies_unshard import placement_case

    pg = cadence.init(cadence.Topology(dp_shard=2, pp=2))
    return {
        "placed": run_subtests({"name": names}, placed_case, pg),
        "lowered": run_subtests(lowered, placement_case, pg),
        # fully_shard stages with a weight tied across stages: the sharded copies sum
        "tied": run_subtests({"name_v": tied}, lambda name_v: case(*name_v, pg=pg, wrap=True)),
    }
