"""Pipeline step time: cadence vs torch.distributed.pipelining, same model/schedule/m.

Run (from the repo root):

    .venv/bin/python bench/bench_pipeline.py --world 2 --steps 10
    .venv/bin/python bench/bench_pipeline.py --world 4 --steps 6   # oversubscribed on 2 cores

Method:
- one process tree per world size; in it, each schedule builds a cadence runtime
  and a torch schedule over two identical copies of TinyGPT, and the two step
  *alternately* (cadence, torch, cadence, ...), so machine load hits both alike;
- one intra-op thread per rank; 2 warm-up steps, then ``--steps`` measured pairs;
- step time = barrier-to-barrier wall time on rank 0; busy time per rank = time
  inside the compute handlers (cadence ``PipelineStage.forward/backward*``, torch
  ``forward_one_chunk/backward_one_chunk/backward_weight_one_chunk``);
- measured bubble = 1 - sum(busy) / (world x step time), against theory (p ranks,
  m microbatches, v chunks: GPipe and 1F1B (p-1)/(m+p-1), interleaved
  (p-1)/(vm+p-1), ZBV 0 within each rank's span) and the schedule layer's
  simulator at equal F = I = W durations;
- the ratio reported is cadence / torch per pair: min / median / max;
- the 1-minute load average is recorded, and flagged when above the core count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from cadence import launch
from cadence.models import GPTConfig, MarkovTokens, TinyGPT

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbv", 2)]


def theory_bubble(name: str, p: int, m: int, v: int) -> float:
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zbv":
        return 0.0  # within each rank's span; only the start stagger remains
    return float("nan")


def sim_bubble(name: str, p: int, m: int, v: int) -> float:
    """The simulator's bubble (idle / (p x makespan)) at equal F = I = W durations."""
    from cadence.pipeline.schedule import generate, lower, simulate

    return simulate(lower(generate(name, p, m, v))).bubble


class _Busy:
    """Accumulates time spent inside wrapped methods (per process)."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, obj, names):
        for n in names:
            fn = getattr(obj, n)

            def timed(*a, __fn=fn, **k):
                t = time.perf_counter()
                try:
                    return __fn(*a, **k)
                finally:
                    self.total += time.perf_counter() - t

            setattr(obj, n, timed)


def _model(cfg: GPTConfig) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(cfg)


def body(args: dict) -> list[dict]:
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import schedules as ts

    from cadence.comm import Comm
    from cadence.pipeline.runtime import build_pipeline
    from cadence.pipeline.schedule import placement_for, torch_schedule_name

    rank, p = dist.get_rank(), dist.get_world_size()
    world = Comm(None, name="bench")
    m = args["m"]
    rows = []
    for name, v in SCHEDULES:
        if args["only"] and name not in args["only"]:
            continue
        n = p * v
        cfg = GPTConfig(
            vocab_size=64,
            seq_len=args["seq"],
            d_model=args["d_model"],
            n_heads=4,
            n_layers=max(args["layers"], n),
        )
        placement = placement_for(name, p, v)
        mine = sorted(s for s, r in placement.items() if r == rank)
        x, y = MarkovTokens(64, args["seq"], seed=0).batch(0, args["batch"])
        # cadence
        c_chunks = _model(cfg).split_stages(n)
        rt = build_pipeline(
            name, c_chunks, n_microbatches=m, chunks=v, loss_fn=TinyGPT.loss, source=args["source"]
        )
        c_busy = _Busy()
        for st in rt.stages.values():
            c_busy.wrap(st, ["forward", "backward", "backward_input", "backward_weight"])
        # torch
        t_chunks = _model(cfg).split_stages(n)
        cls = ts.get_schedule_class(torch_schedule_name(name))
        tstages = [TorchStage(t_chunks[s], s, n, torch.device("cpu")) for s in mine]
        t_busy = _Busy()
        for st in tstages:
            t_busy.wrap(
                st, ["forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"]
            )
        if issubclass(cls, ts.PipelineScheduleSingle):
            tsched = cls(tstages[0], n_microbatches=m, loss_fn=TinyGPT.loss)
        else:
            tsched = cls(tstages, n_microbatches=m, loss_fn=TinyGPT.loss)

        def c_step(rt=rt, x=x, y=y, c_chunks=c_chunks):
            rt.step(x, target=y)
            for c in c_chunks:
                c.zero_grad(set_to_none=True)

        def t_step(tsched=tsched, x=x, y=y, mine=mine, t_chunks=t_chunks):
            tsched.step(*((x,) if 0 in mine else ()), target=y)
            for c in t_chunks:
                c.zero_grad(set_to_none=True)

        samples: dict[str, list[tuple[float, float]]] = {"cadence": [], "torch": []}
        for i in range(args["warmup"] + args["steps"]):
            for label, fn, busy in (("cadence", c_step, c_busy), ("torch", t_step, t_busy)):
                world.barrier()
                b0 = busy.total
                t0 = time.perf_counter()
                fn()
                world.barrier()
                dt = time.perf_counter() - t0
                if i >= args["warmup"]:
                    samples[label].append((dt, busy.total - b0))
        # step time from rank 0's clock; busy from every rank
        busy_all = world.all_gather_object({k: [b for _, b in v] for k, v in samples.items()})
        if rank == 0:
            row = {"schedule": name, "v": v, "m": m, "world": p}
            for label in ("cadence", "torch"):
                times = [t for t, _ in samples[label]]
                busy = [sum(r[label][i] for r in busy_all) for i in range(len(times))]
                bubbles = [1 - b / (p * t) for b, t in zip(busy, times)]
                row[f"{label}_median_ms"] = 1e3 * statistics.median(times)
                row[f"{label}_bubble"] = statistics.median(bubbles)
            ratios = [c / t for (c, _), (t, _) in zip(samples["cadence"], samples["torch"])]
            row["ratio_min"] = min(ratios)
            row["ratio_median"] = statistics.median(ratios)
            row["ratio_max"] = max(ratios)
            row["theory_bubble"] = theory_bubble(name, p, m, v)
            row["sim_bubble"] = sim_bubble(name, p, m, v)
            rows.append(row)
        world.barrier()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--m", type=int, default=0, help="microbatches (default 2 x world)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--source", default="cadence", choices=["cadence", "torch"])
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    args = {
        "m": a.m or 2 * a.world,
        "steps": a.steps,
        "warmup": a.warmup,
        "batch": a.batch,
        "seq": a.seq,
        "d_model": a.d_model,
        "layers": a.layers,
        "source": a.source,
        "only": a.only,
    }
    load0 = os.getloadavg()[0]
    # Import ourselves by module name so the ranks can unpickle ``body`` by reference
    # (a __main__ function only travels by value).
    import bench_pipeline

    rows = launch(
        bench_pipeline.body, args, nprocs=a.world, backend="gloo", num_threads=1, timeout=1200
    )[0]
    load1 = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    print(f"world={a.world} m={args['m']} batch={a.batch} d_model={a.d_model} source={a.source}")
    print(f"load average before/after: {load0:.2f} / {load1:.2f} on {cores} cores", end="")
    print("  (OVERSUBSCRIBED: ratios only)" if a.world > cores or load1 > cores else "")
    head = "schedule      cadence ms  torch ms  ratio min/med/max     bubble c / t / sim / theory"
    print(head)
    for r in rows:
        sim = f"{r['sim_bubble']:.3f}"
        print(
            f"{r['schedule'] + ' v=' + str(r['v']):13s} {r['cadence_median_ms']:9.1f} "
            f"{r['torch_median_ms']:9.1f}  {r['ratio_min']:.3f}/{r['ratio_median']:.3f}/"
            f"{r['ratio_max']:.3f}   {r['cadence_bubble']:.3f} / {r['torch_bubble']:.3f} / "
            f"{sim} / {r['theory_bubble']:.3f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "load": [load0, load1], "args": args}, f, indent=2)


if __name__ == "__main__":
    main()
