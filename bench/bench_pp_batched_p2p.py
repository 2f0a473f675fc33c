"""Pipeline step time with and without batched P2P (``build_pipeline(batch_p2p=True)``).

Run (from the repo root):

    .venv/bin/python bench/bench_pp_batched_p2p.py --world 2 --steps 10
    .venv/bin/python bench/bench_pp_batched_p2p.py --world 2 --steps 2 --d-model 16  # smoke

Method:
- one process tree; per (schedule, channel mode) two runtimes over identical
  TinyGPT copies, one posting each SEND/RECV alone and one posting each run of
  consecutive SEND/RECV as one ``batch_isend_irecv`` per communicator; the two
  step *alternately*, so machine load hits both alike;
- one intra-op thread per rank; ``--warmup`` steps, then ``--steps`` measured pairs;
- step time = barrier-to-barrier wall time on rank 0; the ratio is batched /
  single per pair (min / median / max), with the number of posts per step;
- the shared channel mode (one communicator, where batching can pair a send and a
  receive with the same peer) only for schedules the simulator accepts there;
- gloo does not coalesce a batch (it issues the ops one by one), so CPU figures
  bound the overhead of batching; the gain it is for needs NCCL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from cadence import launch
from cadence.models import GPTConfig, MarkovTokens, TinyGPT

SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb_h1", 1), ("zbv", 2)]


def _shared_ok(name: str, p: int, m: int, v: int) -> bool:
    from cadence.pipeline.schedule import generate, lower, verify

    try:
        verify(lower(generate(name, p, m, v)), mode="shared")
    except Exception:
        return False
    return True


def body(args: dict) -> list[dict]:
    from cadence.pipeline.runtime import build_pipeline

    p, m = dist.get_world_size(), args["m"]
    rows = []
    for name, v in SCHEDULES:
        for mode in ("per_directed_edge", "shared"):
            if mode == "shared" and not _shared_ok(name, p, m, v):
                continue
            cfg = GPTConfig(
                vocab_size=64, seq_len=args["seq"], d_model=args["d_model"], n_layers=p * v
            )
            rts = []
            for batch in (False, True):
                torch.manual_seed(0)
                chunks = TinyGPT(cfg).split_stages(p * v)
                rts.append(
                    build_pipeline(
                        name,
                        chunks,
                        n_microbatches=m,
                        chunks=v,
                        loss_fn=TinyGPT.loss,
                        channel_mode=mode,  # type: ignore[arg-type]
                        batch_p2p=batch,
                    )
                )
            x, y = MarkovTokens(64, args["seq"], seed=1).batch(0, args["batch"])
            times: list[list[float]] = [[], []]
            for it in range(args["warmup"] + args["steps"]):
                for k, rt in enumerate(rts):
                    dist.barrier()
                    t0 = time.perf_counter()
                    rt.step(x, target=y)
                    dist.barrier()
                    if it >= args["warmup"]:
                        times[k].append(time.perf_counter() - t0)
            ratios = [b / s for s, b in zip(*times)]
            steps = args["warmup"] + args["steps"]
            rows.append(
                {
                    "schedule": f"{name} v={v}",
                    "mode": mode,
                    "single_ms": 1e3 * statistics.median(times[0]),
                    "batched_ms": 1e3 * statistics.median(times[1]),
                    "ratio": (min(ratios), statistics.median(ratios), max(ratios)),
                    "posts_single": sum(a.kind.name in ("SEND", "RECV") for a in rts[0].actions),
                    "posts_batched": rts[1].p2p_batches // steps,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--m", type=int, default=0, help="microbatches (default 2 x world)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=64)
    a = ap.parse_args()
    m = a.m or 2 * a.world
    args = {"m": m, "steps": a.steps, "warmup": a.warmup, "batch": a.batch}
    args |= {"seq": a.seq, "d_model": a.d_model}
    import bench_pp_batched_p2p  # by module name, so the ranks unpickle body by reference

    load0 = os.getloadavg()[0]
    rows = launch(bench_pp_batched_p2p.body, args, nprocs=a.world, backend="gloo", num_threads=1)[0]
    load1 = os.getloadavg()[0]
    print(f"world={a.world} m={m} batch={a.batch} d_model={a.d_model}")
    print(f"load average before/after: {load0:.2f} / {load1:.2f} on {os.cpu_count()} cores")
    print("schedule         mode               single ms  batched ms  ratio min/med/max  posts")
    for r in rows:
        lo, med, hi = r["ratio"]
        print(
            f"{r['schedule']:16s} {r['mode']:18s} {r['single_ms']:9.2f} {r['batched_ms']:10.2f}"
            f"  {lo:.3f}/{med:.3f}/{hi:.3f}  {r['posts_single']} -> {r['posts_batched']}"
        )


if __name__ == "__main__":
    main()
