"""``cadence bench pp --batch-p2p``: pipeline step time with and without batched P2P
(``build_pipeline(batch_p2p=True)``).

One process tree; per (schedule, channel mode) two runtimes over identical TinyGPT
copies, one posting each SEND/RECV alone and one posting each run of consecutive
SEND/RECV as one ``batch_isend_irecv`` per communicator, step alternately (one
intra-op thread per rank); a step's time is rank 0's, barrier to barrier. The ratio is
batched / single per pair, with the number of posts per step. The shared channel mode
(one communicator, where a batch can pair a send and a receive with the same peer)
runs only for the schedules the simulator accepts there. gloo does not coalesce a
batch (it issues the ops one by one), so CPU figures bound the overhead of batching;
the gain it is for needs NCCL.
"""

from __future__ import annotations

import time
from typing import Any

from cadence.bench._loop import launch_ranks, loadavg
from cadence.bench._record import make_record, timed_row

__all__ = ["SCHEDULES", "rank_body", "run"]

SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb_h1", 1), ("zbv", 2)]
MODES = ("per_directed_edge", "shared")
FULL = {"width": 64, "batch": 32, "seq": 16}
TINY = {"width": 16, "batch": 8, "seq": 8}
VOCAB = 64


def _shared_ok(name: str, p: int, m: int, v: int) -> bool:
    """Whether the schedule is valid on one shared communicator."""
    from cadence.pipeline.schedule import generate, lower, verify

    try:
        verify(lower(generate(name, p, m, v)), mode="shared")
    except Exception:  # any refusal: the schedule is not for the shared mode
        return False
    return True


def rank_body(spec: dict[str, Any], warmup: int, reps: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from cadence.models import GPTConfig, MarkovTokens, TinyGPT
    from cadence.pipeline.runtime import build_pipeline

    p, m = dist.get_world_size(), spec["microbatches"]
    x, y = MarkovTokens(VOCAB, spec["seq"], seed=1).batch(0, spec["batch"])
    out = []
    for name, v in SCHEDULES:
        for mode in MODES:
            if mode == "shared" and not _shared_ok(name, p, m, v):
                continue
            cfg = GPTConfig(vocab_size=VOCAB, seq_len=spec["seq"], d_model=spec["width"],
                            n_layers=p * v)  # fmt: skip
            runtimes = []
            for batch in (False, True):
                torch.manual_seed(0)
                runtimes.append(
                    build_pipeline(name, TinyGPT(cfg).split_stages(p * v), n_microbatches=m,
                                   chunks=v, loss_fn=TinyGPT.loss,
                                   channel_mode=mode,  # type: ignore[arg-type]
                                   batch_p2p=batch)
                )  # fmt: skip
            times: dict[str, list[float]] = {"single": [], "batched": []}
            for i in range(warmup + reps):
                # Two sides: alternating is the rotation of [Note: interleaving].
                order = list(zip(times, runtimes, strict=True))
                for side, rt in order if i % 2 == 0 else reversed(order):
                    dist.barrier()
                    t0 = time.perf_counter()
                    rt.step(x, target=y)
                    dist.barrier()
                    if i >= warmup:
                        times[side].append(time.perf_counter() - t0)
            single, batched = runtimes
            out.append(
                {
                    "case": f"{name} v={v}, {mode}",
                    "times": times,
                    "posts_single": sum(a.kind.name in ("SEND", "RECV") for a in single.actions),
                    "posts_batched": batched.p2p_batches // (warmup + reps),
                }
            )
    return out


def run(
    *,
    quick: bool,
    tiny: bool = False,
    world: int = 2,
    width: int | None = None,
    batch: int | None = None,
) -> dict[str, Any]:
    """Run the comparison and return its record (not yet written)."""
    from cadence.bench import _batch_p2p as this

    spec: dict[str, Any] = dict(TINY if tiny else FULL, microbatches=2 * world)
    spec |= {k: v for k, v in (("width", width), ("batch", batch)) if v}
    warmup, reps = (1, 2) if tiny else (1, 4) if quick else (2, 10)
    load0 = loadavg()
    # gloo on CPU: the figure is batching's overhead (see above).
    per_rank = launch_ranks(this.rank_body, spec, warmup, reps, world=world, timeout=1800,
                            backend="gloo")  # fmt: skip
    rows = [
        timed_row(
            r["case"],
            r["times"],
            mine="batched",
            ref="single",
            ref_b=None,
            target=None,
            extra={"posts_single": r["posts_single"], "posts_batched": r["posts_batched"]},
        )
        for r in per_rank[0]  # every step ends with a barrier: rank 0's clock is the pipeline's
    ]
    record = make_record(
        "pp-batch-p2p",
        quick=quick,
        rows=rows,
        load_before=load0,
        settings={"world": world, "backend": "gloo", "warmup": warmup, "reps": reps, **spec,
                  "model": "TinyGPT, one layer per stage", "threads_per_rank": 1},
    )  # fmt: skip
    record["what"] = "batch_isend_irecv / one post per SEND or RECV"
    return record
