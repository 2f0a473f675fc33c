"""cadence.fully_shard against torch's fully_shard (and cadence.DataParallel memory).

Run:  .venv/bin/python bench/bench_fsdp.py [--world 2] [--reps 9] [--dim 512] [--layers 8]

Both wrappers live in the same rank processes and alternate step by step (the order
flips every repetition), so machine noise hits both alike. Per repetition the step
time is the slowest rank's; the ratio cadence / torch is reported as min / median /
max over repetitions. Peak memory per rank comes from torch's MemTracker (private,
``torch.distributed._tools``) over one tracked step after the timed ones; it sees
storage resizes, which both FSDP implementations use to free unsharded parameters.
Targets: step-time ratio <= 0.7 (cadence's asynchronous collectives should hide part
of the communication FSDP2 waits for synchronously on CPU) and peak-memory ratio
<= 1.0 (sharding must not cost more memory than the FSDP2 it replaces).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))


class Net(nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers)
        )
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _cadence(net: Net, max_inflight: int = 1) -> tuple[nn.Module, Callable[[], None]]:
    from cadence.fsdp import fully_shard

    for b in net.blocks:
        fully_shard(b)
    model = fully_shard(net)
    model.set_max_inflight_reductions(max_inflight)  # type: ignore[operator]
    return model, lambda: None


def _torch(net: Net) -> tuple[nn.Module, Callable[[], None]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in net.blocks:
        fully_shard(b, mesh=mesh)
    return fully_shard(net, mesh=mesh), lambda: None


def _data_parallel(net: Net) -> tuple[nn.Module, Callable[[], None]] | None:
    try:
        from cadence.data_parallel import DataParallel
    except ImportError:
        return None
    return DataParallel(net), lambda: None


def _peak_bytes(model: nn.Module, opt: torch.optim.Optimizer, step: Callable[[], None]) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")
    return int(sum(snap["Total"] for snap in peak.values()))


def rank_body(
    dim: int, layers: int, batch: int, reps: int, warmup: int, max_inflight: int
) -> dict[str, Any]:
    rank = dist.get_rank()
    base = Net(dim, layers)
    builders: dict[str, Callable[[Net], Any]] = {
        "cadence": lambda net: _cadence(net, max_inflight),
        "torch": _torch,
    }
    runs: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for name, build in builders.items():
        model, _ = build(copy.deepcopy(base))
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, dim, generator=g)

    def step(name: str) -> None:
        model, opt = runs[name]
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    times: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(warmup + reps):
        order = list(runs) if rep % 2 == 0 else list(reversed(runs))
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            step(name)
            elapsed = time.perf_counter() - t0
            if rep >= warmup:
                times[name].append(elapsed)
    peaks = {name: _peak_bytes(*runs[name], lambda n=name: step(n)) for name in runs}
    dp = _data_parallel(copy.deepcopy(base))
    if dp is not None:
        dp_model = dp[0]
        dp_opt = torch.optim.AdamW(dp_model.parameters(), lr=1e-3)

        def dp_step() -> None:
            dp_model(x).pow(2).mean().backward()
            dp_opt.step()
            dp_opt.zero_grad()

        dp_step()
        peaks["data_parallel"] = _peak_bytes(dp_model, dp_opt, dp_step)
    return {"times": times, "peaks": peaks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--max-inflight", type=int, default=1, help="cadence reduce-scatters in flight (0: sync)"
    )
    args = parser.parse_args()

    import bench_fsdp  # by reference, so the ranks can import it
    from cadence import launch

    results = launch(
        bench_fsdp.rank_body,
        args.dim,
        args.layers,
        args.batch,
        args.reps,
        args.warmup,
        args.max_inflight,
        nprocs=args.world,
        backend="gloo",
        num_threads=1,
        timeout=600,
    )
    step = {
        name: [max(r["times"][name][i] for r in results) for i in range(args.reps)]
        for name in ("cadence", "torch")
    }
    ratios = sorted(c / t for c, t in zip(step["cadence"], step["torch"]))
    print(
        f"model: {args.layers} x Linear({args.dim},{args.dim}) + head, AdamW, batch "
        f"{args.batch}/rank, world {args.world}, {args.reps} reps (gloo, 1 thread/rank), "
        f"cadence max_inflight_reductions={args.max_inflight}"
    )
    print("| metric | cadence | torch fully_shard | ratio (cadence / torch) |")
    print("|---|---|---|---|")
    med_c, med_t = statistics.median(step["cadence"]), statistics.median(step["torch"])
    print(
        f"| step time, median ms | {med_c * 1e3:.1f} | {med_t * 1e3:.1f} | "
        f"min {ratios[0]:.2f} / median {statistics.median(ratios):.2f} / max {ratios[-1]:.2f} |"
    )
    for rank, r in enumerate(results):
        peaks = r["peaks"]
        row = (
            f"| peak memory rank {rank}, MiB | {peaks['cadence'] / 2**20:.2f} | "
            f"{peaks['torch'] / 2**20:.2f} | {peaks['cadence'] / peaks['torch']:.2f} |"
        )
        if "data_parallel" in peaks:
            row += (
                f" DataParallel {peaks['data_parallel'] / 2**20:.2f} MiB "
                f"(cadence / DP {peaks['cadence'] / peaks['data_parallel']:.2f})"
            )
        print(row)
    if "data_parallel" not in results[0]["peaks"]:
        print("(cadence.DataParallel not importable: DataParallel column skipped)")


if __name__ == "__main__":
    main()
