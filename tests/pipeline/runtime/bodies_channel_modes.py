"""Rank bodies of the channel-mode tests: every schedule under per-direction groups."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cadence
from cadence import EventLog
from cadence.models import GPTConfig, MarkovTokens, TinyGPT
from cadence.pipeline.runtime import build_pipeline
from cadence.pipeline.schedule import ActionKind, Payload, placement_for
from cadence.testing import max_abs_diff, named_grads, run_subtests
from cadence.topology import can_split
from tests._group_spy import spy_groups

# (name, chunks): the schedule families; DualPipeV needs m >= 2p, so m = 2p for all.
SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved", 2),
    ("zb_h1", 1),
    ("zbv", 2),
    ("dualpipev", 2),
]
MODES = ("per_directed_edge", "per_direction")
TOL = 1e-6


def _model(n: int) -> TinyGPT:
    torch.manual_seed(5)
    return TinyGPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=n))


def _grads(chunks, mine) -> dict:
    return {f"{s}.{k}": g for s in mine for k, g in named_grads(chunks[s]).items()}


def mode_case(name: str, v: int, pg: cadence.ParallelGroups | None) -> dict:
    """One schedule under both modes: gradients, losses, groups created, op routes."""
    pp_ranks = list(pg.pp_ranks) if pg is not None else list(range(dist.get_world_size()))
    p, me = len(pp_ranks), pp_ranks.index(dist.get_rank())
    n, m = p * v, 2 * p
    mine = sorted(s for s, r in placement_for(name, p, v).items() if r == me)
    x, y = MarkovTokens(32, 8, seed=2).batch(0, 4 * m)
    if pg is not None:  # each pipeline trains on its data-parallel slice
        rows = pg.local_slice(x.shape[0])
        x, y = x[rows], y[rows]
    ref = _model(n).split_stages(n)
    TinyGPT.loss(torch.nn.Sequential(*ref)(x), y).backward()
    out: dict = {}
    runs = {}
    for mode in MODES:
        chunks = _model(n).split_stages(n)
        log = EventLog()
        with spy_groups() as spy:
            rt = build_pipeline(
                name,
                chunks,
                n_microbatches=m,
                chunks=v,
                groups=pg,
                loss_fn=TinyGPT.loss,
                event_log=log,
                channel_mode=mode,  # type: ignore[arg-type]
            )
        log.clear()  # one step's traffic, not the preconnect
        losses: list = []
        rt.step(x, target=y, losses=losses)
        runs[mode] = (_grads(chunks, mine), [float(t) for t in losses])
        if mode != "per_direction":
            continue
        out["created"], out["calls"], out["can_split"] = spy.groups, spy.calls, can_split()
        # the communicator of every SEND/RECV: one group per payload, over the pp group
        routed = {
            a.payload: rt._route[a][0].group
            for a in rt.actions
            if a.kind in (ActionKind.SEND, ActionKind.RECV)
        }
        out["groups_by_payload"] = len(routed)
        out["distinct_groups"] = len({id(g) for g in routed.values()})
        out["group_sizes"] = sorted(dist.get_world_size(g) for g in routed.values())
        out["group_members"] = sorted(
            tuple(sorted(dist.get_process_group_ranks(g))) for g in routed.values()
        )
        p2p = [e for e in log.collectives() if e.kind in ("send", "recv")]
        planned = [a for a in rt.actions if a.kind in (ActionKind.SEND, ActionKind.RECV)]
        out["n_p2p"] = len(p2p)
        out["events_match_plan"] = len(planned) == len(p2p) and all(
            e.kind == a.kind.name.lower()
            and e.group
            == f"pp{a.channel[0]}->{a.channel[1]}/{'fwd' if a.payload is Payload.ACT else 'bwd'}"
            for a, e in zip(planned, p2p)
        )
    (g_edge, l_edge), (g_dir, l_dir) = runs["per_directed_edge"], runs["per_direction"]
    out["grad_vs_edge"] = max_abs_diff(g_dir, g_edge)
    out["loss_vs_edge"] = max_abs_diff(l_dir, l_edge) if l_dir else 0.0
    out["grad_vs_ref"] = max_abs_diff(g_dir, _grads(ref, mine))
    out["n_grads"] = len(g_dir)
    dist.barrier()
    return out


def body_channel_modes(schedules: list[tuple[str, int]]) -> dict:
    """World 4: one pipeline of 4 ranks, then pp 2 x dp 2 (two pipelines of 2)."""
    grid = {"name_v": schedules}
    pp4 = run_subtests(grid, lambda name_v: mode_case(*name_v, pg=None))
    pg = cadence.init(cadence.Topology(dp_replicate=2, pp=2))
    pp2 = run_subtests(grid, lambda name_v: mode_case(*name_v, pg=pg))
    return {"pp4": pp4, "pp2xdp2": pp2, "pp_group": list(pg.pp_ranks)}


def check_mode_rows(rows: dict[str, dict], pp_groups: list[tuple[int, ...]]) -> list[str]:
    """Problems in one rank's per-schedule rows (shared with the world-2 test)."""
    problems = []
    p = len(pp_groups[0])
    fresh = sorted(g for pp in pp_groups for g in (pp, pp))  # fwd and bwd, per pp group
    first = next(iter(rows.values()))
    # One split per direction where the backend splits, else a new_group per group.
    calls = ["split_group"] * 2 if first["can_split"] else ["new_group"] * len(fresh)
    for case, r in rows.items():
        made = (sorted(r["created"]), r["calls"])
        if made not in (([], []), (fresh, calls)):
            problems.append(f"{case}: created {made}, expected {(fresh, calls)} (or cached)")
        if r["distinct_groups"] != 2 or r["group_sizes"] != [p, p]:
            problems.append(f"{case}: routes over {r['distinct_groups']} groups {r}")
        if not r["events_match_plan"] or r["n_p2p"] == 0:
            problems.append(f"{case}: P2P events do not follow the direction groups")
        if r["n_grads"] == 0 or r["grad_vs_edge"] > TOL or r["grad_vs_ref"] > TOL:
            problems.append(f"{case}: grads {r['grad_vs_edge']:.2e} {r['grad_vs_ref']:.2e}")
        if r["loss_vs_edge"] > TOL:
            problems.append(f"{case}: losses differ by {r['loss_vs_edge']:.2e}")
    if (sorted(first["created"]), first["calls"]) != (fresh, calls):  # the first build makes them
        problems.append(f"first case created {first['created']} by {first['calls']}")
    return problems
