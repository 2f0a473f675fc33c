"""``cadence bench pp --bubbles``: measured pipeline bubbles, cadence and torch, against
the simulator's and the closed form.

One process tree. Per schedule (GPipe, 1F1B, Interleaved1F1B v=2, ZBV v=2) a cadence
runtime and a torch schedule over two identical copies of TinyGPT step alternately
(one intra-op thread per rank); a step's time is rank 0's, barrier to barrier. A
rank's busy time is the time spent inside the compute handlers (cadence's
``PipelineStage.forward/backward*``, torch's ``forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk``), and the measured bubble is
``1 - sum(busy) / (world x step)``, set beside the schedule layer's simulator at equal
F = I = W durations and the closed form (p ranks, m microbatches, v chunks: GPipe and
1F1B (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1), ZBV 0 within each rank's span). The
ratio is cadence / torch per step (no A/A: one torch copy). ``source="torch"`` runs
torch's own lowered action lists under cadence's executor.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from cadence.bench._loop import launch_ranks, loadavg
from cadence.bench._record import make_record, timed_row

__all__ = ["SCHEDULES", "rank_body", "run", "sim_bubble", "theory_bubble"]

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbv", 2)]
FULL = {"layers": 8, "width": 128, "batch": 64, "seq": 32}
TINY = {"layers": 4, "width": 16, "batch": 8, "seq": 8}
VOCAB = 64


def theory_bubble(name: str, p: int, m: int, v: int) -> float:
    """The closed form's idle fraction; ZBV's is 0 within each rank's span."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return 0.0


def sim_bubble(name: str, p: int, m: int, v: int) -> float:
    """The simulator's bubble (idle / (p x makespan)) at equal F = I = W durations."""
    from cadence.pipeline.schedule import generate, lower, simulate

    return simulate(lower(generate(name, p, m, v))).bubble


class _Busy:
    """Seconds spent inside wrapped methods, in this process."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, obj: Any, names: list[str]) -> None:
        for n in names:
            fn = getattr(obj, n)

            def timed(*a: Any, __fn: Callable[..., Any] = fn, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return __fn(*a, **k)
                finally:
                    self.total += time.perf_counter() - t

            setattr(obj, n, timed)


def _schedule(name: str, v: int, spec: dict[str, Any], source: str) -> dict[str, Any] | str:
    """Both sides of one schedule on this rank: step functions and busy counters; or why
    ``source`` cannot run it (torch runs GPipe as a loop, with no action list to lower)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import schedules as ts

    from cadence.models import GPTConfig, MarkovTokens, TinyGPT
    from cadence.pipeline.runtime import build_pipeline
    from cadence.pipeline.runtime.errors import PipelineUsageError
    from cadence.pipeline.schedule import placement_for, torch_schedule_name

    rank, p, m = dist.get_rank(), dist.get_world_size(), spec["microbatches"]
    n = p * v
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=spec["seq"], d_model=spec["width"], n_heads=4,
                    n_layers=max(spec["layers"], n))  # fmt: skip
    x, y = MarkovTokens(VOCAB, spec["seq"], seed=0).batch(0, spec["batch"])

    def chunks() -> list[Any]:
        torch.manual_seed(0)
        return TinyGPT(cfg).split_stages(n)

    c_chunks = chunks()
    try:
        rt = build_pipeline(name, c_chunks, n_microbatches=m, chunks=v, loss_fn=TinyGPT.loss,
                            source=source)  # type: ignore[arg-type]  # fmt: skip
    except PipelineUsageError as exc:
        if source == "cadence":
            raise
        return str(exc)  # the same on every rank: they all skip it
    c_busy = _Busy()
    for st in rt.stages.values():
        c_busy.wrap(st, ["forward", "backward", "backward_input", "backward_weight"])
    t_chunks = chunks()
    mine = sorted(s for s, r in placement_for(name, p, v).items() if r == rank)
    stages = [TorchStage(t_chunks[s], s, n, torch.device("cpu")) for s in mine]
    t_busy = _Busy()
    for t_st in stages:
        t_busy.wrap(t_st, ["forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"])
    cls = ts.get_schedule_class(torch_schedule_name(name))
    if issubclass(cls, ts.PipelineScheduleSingle):
        sched = cls(stages[0], n_microbatches=m, loss_fn=TinyGPT.loss)
    else:
        sched = cls(stages, n_microbatches=m, loss_fn=TinyGPT.loss)

    def c_step() -> None:
        rt.step(x, target=y)
        for c in c_chunks:
            c.zero_grad(set_to_none=True)

    def t_step() -> None:
        sched.step(*((x,) if 0 in mine else ()), target=y)
        for c in t_chunks:
            c.zero_grad(set_to_none=True)

    return {"cadence": (c_step, c_busy), "torch": (t_step, t_busy)}


def rank_body(spec: dict[str, Any], warmup: int, reps: int, source: str) -> dict[str, Any]:
    """Per schedule: rank 0's step seconds and every rank's busy seconds, per side; or why
    it was skipped."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for name, v in SCHEDULES:
        sides = _schedule(name, v, spec, source)
        if isinstance(sides, str):
            out[f"{name} v={v}"] = sides
            continue
        samples: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
        for i in range(warmup + reps):
            # Two sides: alternating is the rotation of [Note: interleaving].
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for side in order:
                step, busy = sides[side]
                dist.barrier()
                b0, t0 = busy.total, time.perf_counter()
                step()
                dist.barrier()  # the step ends when the whole pipeline has drained
                if i >= warmup:
                    samples[side].append((time.perf_counter() - t0, busy.total - b0))
        out[f"{name} v={v}"] = samples
    return out


def _rows(per_rank: list[dict[str, Any]], spec: dict[str, Any], world: int) -> list[Any]:
    rows = []
    m = spec["microbatches"]
    for name, v in SCHEDULES:
        case = f"{name} v={v}"
        if isinstance(per_rank[0][case], str):  # skipped: see `skipped` in the settings
            continue
        # Every step ends with a barrier: rank 0's clock is the pipeline's.
        times = {k: [t for t, _ in s] for k, s in per_rank[0][case].items()}
        extra: dict[str, Any] = {}
        for side in times:
            busy = [sum(b) for b in zip(*([b for _, b in r[case][side]] for r in per_rank))]
            extra[f"bubble_{side}"] = statistics.median(
                1 - b / (world * t) for b, t in zip(busy, times[side], strict=True)
            )
        extra["bubble_sim"] = sim_bubble(name, world, m, v)
        extra["bubble_theory"] = theory_bubble(name, world, m, v)
        rows.append(
            timed_row(f"world {world} {case}", times, mine="cadence", ref="torch", ref_b=None,
                      target=None, extra=extra,
                      what=f"TinyGPT d_model {spec['width']}, {spec['layers']} layers, "
                      f"batch {spec['batch']} x {spec['seq']}, {m} microbatches")
        )  # fmt: skip
    return rows


def run(
    *,
    quick: bool,
    tiny: bool = False,
    world: int = 2,
    layers: int | None = None,
    width: int | None = None,
    batch: int | None = None,
    source: str = "cadence",
) -> dict[str, Any]:
    """Run the comparison and return its record (not yet written)."""
    from cadence.bench import _bubbles as this

    spec: dict[str, Any] = dict(TINY if tiny else FULL, microbatches=2 * world)
    spec |= {k: v for k, v in (("layers", layers), ("width", width), ("batch", batch)) if v}
    warmup, reps = (1, 2) if tiny else (1, 4) if quick else (2, 10)
    load0 = loadavg()
    # Busy time is host time in the handlers: the ranks stay on CPU, over gloo.
    per_rank = launch_ranks(this.rank_body, spec, warmup, reps, source, world=world,
                            timeout=1800, backend="gloo")  # fmt: skip
    record = make_record(
        "pp-bubbles",
        quick=quick,
        rows=_rows(per_rank, spec, world),
        load_before=load0,
        settings={"world": world, "backend": "gloo", "warmup": warmup, "reps": reps, **spec,
                  "source": source, "threads_per_rank": 1,
                  "skipped": {k: v for k, v in per_rank[0].items() if isinstance(v, str)}},
    )  # fmt: skip
    record["what"] = "cadence / torch pipelining; bubble = 1 - busy / (world x step)"
    return record
