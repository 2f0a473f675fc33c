"""``cadence bench pp``: cadence's pipeline runtime against torch pipelining.

Model: 16 x [Linear(512) + GELU], split evenly into ``world x v`` stages; batch
128 in 8 microbatches; MSE loss. Schedules: GPipe, 1F1B, Interleaved1F1B (v=2),
interleaved zero-bubble (torch's ``ScheduleInterleavedZeroBubble``, v=2) and ZBV
(v=2), at world 2 and 4 (world 4 oversubscribes a 2-core machine: read its ratios,
not its times). cadence's runtime, torch's schedule and a second torch schedule
(A/A) step interleaved in the same ranks (see [Note: interleaving] in
``_loop.py``); a step ends with a barrier, so its time is the whole pipeline's.
Target: <= 0.95 per schedule.
"""

from __future__ import annotations

from typing import Any

from cadence.bench._loop import device_and_backend, interleave, launch_ranks, loadavg, rank_device
from cadence.bench._record import make_record, timed_row

__all__ = ["SCHEDULES", "mse", "rank_body", "run"]

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
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    from cadence.pipeline.runtime import build_pipeline
    from cadence.pipeline.schedule import placement_for, torch_schedule_name

    rank, p = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    m = sizes["microbatches"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sizes["batch"], sizes["width"], generator=g).to(device)
    y = torch.randn(sizes["batch"], sizes["width"], generator=g).to(device)
    out: dict[str, Any] = {}
    for name, v in SCHEDULES:
        n = p * v
        mine = sorted(s for s, r in placement_for(name, p, v).items() if r == rank)
        c_chunks = _stages(n, sizes, device)
        rt = build_pipeline(name, c_chunks, n_microbatches=m, chunks=v, loss_fn=mse, device=device)
        steps = {"cadence": _cadence_step(rt, c_chunks, x, y)}
        for label in ("torch", "torch_b"):
            chunks = _stages(n, sizes, device)
            stages = [PipelineStage(chunks[s], s, n, torch.device(device)) for s in mine]
            cls = ts.get_schedule_class(torch_schedule_name(name))
            if issubclass(cls, ts.PipelineScheduleSingle):
                sched = cls(stages[0], n_microbatches=m, loss_fn=mse)
            else:
                sched = cls(stages, n_microbatches=m, loss_fn=mse)
            steps[label] = _torch_step(sched, chunks, 0 in mine, x, y)
        out[f"{name} v={v}"] = interleave(steps, warmup=warmup, reps=reps)
    return out


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

    sizes = TINY if tiny else FULL
    warmup, reps = (1, 2) if tiny else (2, 6) if quick else (3, 20)
    worlds = (2,) if tiny else worlds
    load0 = loadavg()
    rows: list[dict[str, Any]] = []
    for world in worlds:
        per_rank = launch_ranks(pp.rank_body, sizes, warmup, reps, world=world, timeout=1800)
        # Every rank's step ends with a barrier, so rank 0's clock is the pipeline's.
        for case, times in per_rank[0].items():
            what = (
                f"{sizes['layers']} x [Linear({sizes['width']}) + GELU], batch "
                f"{sizes['batch']}, {sizes['microbatches']} microbatches"
            )
            rows.append(
                timed_row(f"world {world} {case}", times, mine="cadence", ref="torch",
                          ref_b="torch_b", target=TARGET, what=what)
            )  # fmt: skip
    return make_record(
        "pp",
        quick=quick,
        rows=rows,
        load_before=load0,
        settings={"worlds": list(worlds), "backend": device_and_backend(max(worlds))[1],
                  "warmup": warmup, "reps": reps, **sizes, "threads_per_rank": 1},
    )  # fmt: skip
