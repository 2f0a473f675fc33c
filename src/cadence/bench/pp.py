"""``cadence bench pp``: cadence's pipeline runtime against torch pipelining.

Model: 16 x [Linear(512) + GELU], split evenly into ``world x v`` stages; batch
128 in 8 microbatches; MSE loss. Schedules: GPipe, 1F1B, Interleaved1F1B (v=2),
interleaved zero-bubble (torch's ``ScheduleInterleavedZeroBubble``, v=2) and ZBV
(v=2), at world 2 and 4 (world 4 oversubscribes a 2-core machine: read its ratios,
not its times). cadence's runtime, torch's schedule and a second torch schedule
(A/A) step interleaved in the same ranks (see [Note: interleaving] in
``_loop.py``); a step ends with a barrier, so its time is the whole pipeline's.
Target: <= 0.95 per schedule.

Before timing, each schedule steps once on each side from the same weights: the row's
``parity`` holds both sides' per-microbatch losses and the largest gradient difference
(the tiny run's test asserts them bitwise equal).

On a link (``--link RATE[,delay=MS]``) each row also carries ``link``: what the
schedule's own dependencies allow there, from cadence's simulator (see [Note: a
pipeline's bound on a delayed link]), and each variant's step over it; at world 2,
``trace``: one traced step per side, drawn as the case's timeline picture
(`cadence.bench._pp_trace`).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from cadence.bench._loop import device_and_backend, interleave, launch_ranks, loadavg, rank_device
from cadence.bench._record import make_record, timed_row

__all__ = ["SCHEDULES", "link_bound", "mse", "rank_body", "run", "timeline_path", "write_chart"]

TARGET = 0.95
# (cadence generator name, chunks per rank)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb_h1", 2), ("zbv", 2)]
FULL = {"layers": 16, "width": 512, "batch": 128, "microbatches": 8}
TINY = {"layers": 4, "width": 8, "batch": 8, "microbatches": 4}


def mse(out: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.mse_loss(out, target)


def _stages(n: int, sizes: dict[str, Any], device: str) -> list[Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    w = sizes["width"]
    layers = [nn.Sequential(nn.Linear(w, w), nn.GELU()) for _ in range(sizes["layers"])]
    per = len(layers) // n
    return [nn.Sequential(*layers[i * per : (i + 1) * per]).to(device) for i in range(n)]


def rank_body(sizes: dict[str, Any], warmup: int, reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from cadence.bench._pp_trace import trace_step
    from cadence.link import active_link
    from cadence.pipeline.runtime import build_pipeline
    from cadence.pipeline.schedule import placement_for

    rank, p = dist.get_rank(), dist.get_world_size()
    on_link = active_link() is not None
    device = rank_device()
    m = sizes["microbatches"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sizes["batch"], sizes["width"], generator=g).to(device)
    y = torch.randn(sizes["batch"], sizes["width"], generator=g).to(device)
    out: dict[str, Any] = {"_compute": _compute_ms(sizes, p, device)}
    dist.barrier()  # each rank timed its stage alone
    for name, v in SCHEDULES:
        n = p * v
        mine = sorted(s for s, r in placement_for(name, p, v).items() if r == rank)
        c_chunks = _stages(n, sizes, device)
        rt = build_pipeline(name, c_chunks, n_microbatches=m, chunks=v, loss_fn=mse, device=device)
        steps = {"cadence": _cadence_step(rt, c_chunks, x, y)}
        sides = {label: _torch_side(name, n, mine, sizes, device) for label in ("torch", "torch_b")}
        t_sched, t_chunks = sides["torch"]
        parity = _parity(rt, t_sched, [c_chunks[s] for s in mine],
                         [t_chunks[s] for s in mine], 0 in mine, x, y)  # fmt: skip
        for label, (sched, chunks) in sides.items():
            steps[label] = _torch_step(sched, chunks, 0 in mine, x, y)
        result = {"times": interleave(steps, warmup=warmup, reps=reps), "parity": parity}
        if on_link and p == 2:  # one traced step per side, drawn per case (world 4 shares cores)
            result["trace"] = {
                "cadence": trace_step(steps["cadence"], {s: c_chunks[s] for s in mine}),
                "torch": trace_step(steps["torch"], {s: t_chunks[s] for s in mine}),
            }
        out[f"{name} v={v}"] = result
    return out


def _torch_side(
    name: str, n: int, mine: list[int], sizes: dict[str, Any], device: str
) -> tuple[Any, list[Any]]:
    """torch's schedule of ``name`` over fresh chunks (the same weights as cadence's)."""
    import torch
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    from cadence.pipeline.schedule import torch_schedule_name

    m = sizes["microbatches"]
    chunks = _stages(n, sizes, device)
    stages = [PipelineStage(chunks[s], s, n, torch.device(device)) for s in mine]
    cls = ts.get_schedule_class(torch_schedule_name(name))
    if issubclass(cls, ts.PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=m, loss_fn=mse), chunks
    return cls(stages, n_microbatches=m, loss_fn=mse), chunks


def _parity(
    rt: Any, sched: Any, mine_c: list[Any], mine_t: list[Any], first: bool, x: Any, y: Any
) -> dict[str, Any]:
    """One step of each side from the same weights, before any is timed: this rank's
    per-microbatch losses (where it holds the last stage) and the largest gradient
    difference over its stages. The steps time the same arithmetic as torch's."""

    c_losses: list[Any] = []
    t_losses: list[Any] = []
    rt.step(x, target=y, losses=c_losses)
    sched.step(*((x,) if first else ()), target=y, losses=t_losses)
    diff = 0.0
    for c, t in zip(mine_c, mine_t, strict=True):
        for pc, pt in zip(c.parameters(), t.parameters(), strict=True):
            assert pc.grad is not None and pt.grad is not None  # both stepped backward
            diff = max(diff, (pc.grad - pt.grad).abs().max().item())
        c.zero_grad(set_to_none=True)
        t.zero_grad(set_to_none=True)
    return {
        "losses_cadence": [float(v.detach()) for v in c_losses],
        "losses_torch": [float(v.detach()) for v in t_losses],
        "grad_max_abs_diff": diff,
    }


# [Note: a pipeline's bound on a delayed link]
# Where point-to-point latency dominates, the shortest step a schedule allows is its
# critical path with every message paying the link's one-way latency. cadence's
# simulator computes it from the schedule itself (its lowered action lists, `simulate`
# with eager sends: a send never holds its sender) and a `TimeModel`:
# - ``f`` and ``b``: one microbatch's forward and backward through a full stage
#   (``layers / p`` layers), timed on each rank alone, with no communication (median,
#   slowest rank); the zero-bubble schedules split ``b`` into equal ``I`` and ``W``
#   halves (an estimate);
# - ``alpha``: the one-way delay asked for (every packet is held at least that long;
#   the self-check's round trip also carries its own probe's costs, so half of it
#   would overstate a message's latency and the bound with it), or without a delay
#   half the measured round trip;
# - ``beta`` and ``message_bytes``: the measured rate and one microbatch's activation.
# ``bound_ms`` is that makespan; ``compute_ms`` the same schedule with free messages,
# so ``bound_ms - compute_ms`` is the latency no placement of waits can hide. Each
# variant's ``over_bound`` is its step over ``bound_ms``: 1.00 is the schedule's best.
# The bound is the same for cadence and torch (the same schedule, the same stages).


def _compute_ms(sizes: dict[str, Any], p: int, device: str, reps: int = 7) -> dict[str, float]:
    """One microbatch's forward and backward through a full stage, no communication."""
    import time

    import torch

    stage = _stages(p, sizes, device)[0]
    mb = sizes["batch"] // sizes["microbatches"]
    x = torch.randn(mb, sizes["width"], device=device)
    fwd, bwd = [], []
    for _ in range(reps + 1):  # the first warms up
        t0 = time.perf_counter()
        loss = stage(x).square().mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return {"f_ms": 1e3 * statistics.median(fwd[1:]), "b_ms": 1e3 * statistics.median(bwd[1:])}


def link_bound(
    name: str, p: int, v: int, sizes: dict[str, Any], compute: dict[str, float], link: Any
) -> dict[str, float]:
    """The makespans of [Note: a pipeline's bound on a delayed link], in ms."""
    from cadence.pipeline.schedule import TimeModel, generate, lower, simulate

    b = compute["b_ms"]
    one_way = link.spec.delay_ms or link.rtt_ms / 2
    plan = lower(generate(name, p, sizes["microbatches"], v))
    mb_bytes = 4 * sizes["width"] * sizes["batch"] // sizes["microbatches"]
    free = TimeModel(f=compute["f_ms"], i=b / 2, w=b / 2, b=b)
    timed = TimeModel(
        f=compute["f_ms"], i=b / 2, w=b / 2, b=b, alpha=one_way,
        beta=link.measured_bps / 8 / 1e3, message_bytes=mb_bytes,
    )  # fmt: skip
    return {
        "compute_ms": simulate(plan, send="eager", time=free).makespan,
        "bound_ms": simulate(plan, send="eager", time=timed).makespan,
        "one_way_ms": one_way,
        "f_ms": compute["f_ms"],
        "b_ms": b,
    }


def timeline_path(record_png: Path, case: str) -> Path:
    """Where a case's timeline picture goes, beside its record's chart."""
    name = case.replace(" ", "_").replace("=", "")
    return record_png.with_name(f"{record_png.stem}-{name}-timeline.png")


def write_chart(record: dict[str, Any], path: Path) -> Path | None:
    """The record's ratio chart, and on a link one timeline picture per world-2 case."""
    from cadence.bench._pp_trace import write_pp_timeline
    from cadence.bench._record import write_chart as ratio_chart

    st = record["settings"]
    for row in record["rows"]:
        if "trace" in row:
            delay = f", {st['link_delay_ms']:g} ms delay" if st.get("link_delay_ms") else ""
            rate = (st.get("link_rate_measured_bps") or 0) / 1e9
            title = f"{row['case']} on a {rate:.3g} Gbit/s link{delay}: one traced step per side"
            write_pp_timeline(row, timeline_path(path, row["case"]), title)
    return ratio_chart(record, path)


def _cadence_step(rt: Any, chunks: list[Any], x: Any, y: Any) -> Any:
    import torch.distributed as dist

    def step() -> None:
        rt.step(x, target=y)
        for c in chunks:
            c.zero_grad(set_to_none=True)
        dist.barrier()  # the step ends when the whole pipeline has drained

    return step


def _torch_step(sched: Any, chunks: list[Any], first: bool, x: Any, y: Any) -> Any:
    import torch.distributed as dist

    def step() -> None:
        sched.step(*((x,) if first else ()), target=y)
        for c in chunks:
            c.zero_grad(set_to_none=True)
        dist.barrier()

    return step


def run(*, quick: bool, tiny: bool = False, worlds: tuple[int, ...] = (2, 4)) -> dict[str, Any]:
    """Run the comparison at each world size and return one record (not yet written)."""
    from cadence.bench import pp
    from cadence.link import active_link

    sizes = TINY if tiny else FULL
    warmup, reps = (1, 2) if tiny else (2, 6) if quick else (3, 20)
    worlds = (2,) if tiny else worlds
    load0 = loadavg()
    rows: list[dict[str, Any]] = []
    link = active_link()
    # On a link (with or without a delay): the bound of [Note: a pipeline's bound on a
    # delayed link]; without a delay it says how far the runtime's own costs put a step
    # from the schedule's, which the delayed run is read against.
    measured = link is not None and link.rtt_ms is not None and link.measured_bps is not None
    for world in worlds:
        per_rank = launch_ranks(pp.rank_body, sizes, warmup, reps, world=world, timeout=1800)
        compute = {k: max(r["_compute"][k] for r in per_rank) for k in ("f_ms", "b_ms")}
        # Every rank's step ends with a barrier, so rank 0's clock is the pipeline's.
        for case, result in per_rank[0].items():
            if case == "_compute":
                continue
            times = result["times"]
            parity = [r[case]["parity"] for r in per_rank]
            what = (
                f"{sizes['layers']} x [Linear({sizes['width']}) + GELU], batch "
                f"{sizes['batch']}, {sizes['microbatches']} microbatches"
            )
            extra = None
            if measured:
                name, v = next((n, v) for n, v in SCHEDULES if case == f"{n} v={v}")
                extra = {"link": link_bound(name, world, v, sizes, compute, link)}
                for k in ("cadence", "torch"):
                    step_ms = 1e3 * statistics.median(times[k])
                    extra["link"][f"over_bound_{k}"] = step_ms / extra["link"]["bound_ms"]
            row = timed_row(f"world {world} {case}", times, mine="cadence", ref="torch",
                            ref_b="torch_b", target=TARGET, what=what, extra=extra)  # fmt: skip
            # The rank that holds the last stage has the losses; every rank its grads.
            row["parity"] = {
                "losses_cadence": next(q["losses_cadence"] for q in parity if q["losses_cadence"]),
                "losses_torch": next(q["losses_torch"] for q in parity if q["losses_torch"]),
                "grad_max_abs_diff": max(q["grad_max_abs_diff"] for q in parity),
            }
            if "trace" in result:
                row["trace"] = {k: {str(i): r[case]["trace"][k] for i, r in enumerate(per_rank)}
                                for k in ("cadence", "torch")}  # fmt: skip
            rows.append(row)
    return make_record(
        "pp",
        quick=quick,
        rows=rows,
        load_before=load0,
        settings={"worlds": list(worlds), "backend": device_and_backend(max(worlds))[1],
                  "warmup": warmup, "reps": reps, **sizes, "threads_per_rank": 1},
    )  # fmt: skip
