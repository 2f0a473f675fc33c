"""``cadence bench fsdp``: cadence.fully_shard against torch's FSDP2.

Model: N x [Linear(d) + GELU] + Linear(d, 1), one fully_shard unit per block plus
the root, SGD, a small batch (the case where per-unit overhead dominates). Four
configurations per shape: explicit prefetch (each block prefetches its neighbour
in forward and in backward, on both sides) on/off x ``reshard_after_forward`` of
the blocks on/off (the root keeps each library's default).

Step time: cadence, cadence with ``set_max_inflight_reductions(0)`` (each
reduce-scatter waited at once: no overlap, FSDP2's memory), cadence with gloo's own
collectives (``CollectiveAlgorithms.native()``, what FSDP2 calls), FSDP2 and a second
FSDP2 (A/A) in the same ranks, interleaved (see [Note: interleaving] in
``_loop.py``); target <= 0.70.

Peak memory growth per rank: each implementation in a fresh process tree, see
[Note: measuring peak memory growth] in ``_memory.py``. Target <= 1.00.
"""

from __future__ import annotations

import copy
import gc
from typing import Any, cast

from cadence.bench._loop import (
    device_and_backend,
    interleave,
    launch_ranks,
    loadavg,
    rank_device,
    slowest_per_rep,
)
from cadence.bench._memory import MEMORY_ENV, floor_page, memory_row, peak_growth
from cadence.bench._record import make_record, timed_row

__all__ = ["CONFIGS", "SHAPES", "rank_body", "rss_body", "run"]

TIME_TARGET = 0.70
MEMORY_TARGET = 1.00

SHAPES: dict[str, dict[str, Any]] = {
    "12x1024": {"layers": 12, "dim": 1024, "batch": 16},
    "8x512": {"layers": 8, "dim": 512, "batch": 32},
}
TINY = {"tiny": {"layers": 2, "dim": 16, "batch": 4}}
# (prefetch, reshard_after_forward of the blocks)
CONFIGS = [(False, True), (True, True), (False, False), (True, False)]
# (variant, implementation): cadence as configured by default (one reduce-scatter in
# flight), cadence waiting each reduce-scatter at once, FSDP2, FSDP2 again (A/A).
VARIANTS = [("cadence", "cadence"), ("cadence_sync", "cadence_sync"),
            ("cadence_native", "cadence_native"), ("torch", "torch"),
            ("torch_b", "torch")]  # fmt: skip
# Rows per cadence variant: what its suffix says it changes from the default.
CADENCE_ROWS = (
    ("cadence", ""),
    ("cadence_sync", ", max_inflight_reductions=0"),
    ("cadence_native", ", gloo's own collectives"),
)


def _net(layers: int, dim: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(dim, 1))


def _shard(impl: str, net: Any, prefetch: bool, reshard: bool, device: str) -> Any:
    """Per-block units + root, with the same options on either side."""
    import torch.distributed as dist

    blocks = list(net)[:-1]
    if impl.startswith("cadence"):
        from cadence.fsdp import FullyShardedModule, fully_shard

        for b in blocks:
            fully_shard(b, reshard_after_forward=reshard)
        # fully_shard swaps the root's class to a FullyShardedModule subclass.
        root = cast(FullyShardedModule, fully_shard(net))
        # cadence_sync: each reduce-scatter waited at once, FSDP2-on-CPU's memory
        # profile (see [Note: bounded in-flight reductions] in cadence.fsdp._root_runtime).
        root.set_max_inflight_reductions(0 if impl == "cadence_sync" else 1)
        if impl == "cadence_native":
            # What fully_shard's own design gives, without the exchange collectives
            # (see [Note: why cadence replaces some of gloo's collectives]).
            from cadence.comm import CollectiveAlgorithms

            root.set_collective_algorithms(CollectiveAlgorithms.native())
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh(device.split(":")[0], (dist.get_world_size(),))
        for b in blocks:
            torch_fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
        root = torch_fully_shard(net, mesh=mesh)
    if prefetch:
        for i, b in enumerate(blocks):
            if i + 1 < len(blocks):
                b.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                b.set_modules_to_backward_prefetch([blocks[i - 1]])
    return root


def _stepper(model: Any, x: Any) -> Any:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def rank_body(shapes: dict[str, dict[str, Any]], warmup: int, reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    device = rank_device()
    out: dict[str, Any] = {}
    for shape, s in shapes.items():
        base = _net(s["layers"], s["dim"]).to(device)
        g = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randn(s["batch"], s["dim"], generator=g).to(device)
        for prefetch, reshard in CONFIGS:
            steps = {
                name: _stepper(_shard(impl, copy.deepcopy(base), prefetch, reshard, device), x)
                for name, impl in VARIANTS
            }
            out[f"{shape}|{prefetch}|{reshard}"] = interleave(steps, warmup=warmup, reps=reps)
            del steps
            gc.collect()
    return out


def rss_body(impl: str, shapes: dict[str, dict[str, Any]], steps: int) -> dict[str, Any]:
    """Peak RSS growth (bytes) per configuration, for one implementation, this rank."""
    import torch
    import torch.distributed as dist

    device = rank_device()
    out: dict[str, Any] = {}
    for shape, s in shapes.items():
        g = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randn(s["batch"], s["dim"], generator=g).to(device)
        for prefetch, reshard in CONFIGS:
            model = _shard(impl, _net(s["layers"], s["dim"]).to(device), prefetch, reshard, device)
            step = _stepper(model, x)
            gc.collect()
            dist.barrier()
            out[f"{shape}|{prefetch}|{reshard}"] = peak_growth(step, steps, device)
            dist.barrier()
            del model, step
            gc.collect()
    return out


def _case(key: str) -> tuple[str, str]:
    shape, prefetch, reshard = key.split("|")
    return (
        shape,
        f"prefetch {'on' if prefetch == 'True' else 'off'}, reshard {'on' if reshard == 'True' else 'off'}",
    )


def run(*, quick: bool, tiny: bool = False, world: int = 2) -> dict[str, Any]:
    """Run the comparison and return its record (not yet written)."""
    from cadence.bench import fsdp

    shapes = TINY if tiny else {"12x1024": SHAPES["12x1024"]} if quick else SHAPES
    warmup, reps = (1, 2) if tiny else (2, 6) if quick else (3, 25)
    mem_steps = 2 if tiny else 3
    load0 = loadavg()
    per_rank = launch_ranks(fsdp.rank_body, shapes, warmup, reps, world=world, timeout=1800)
    rows: list[dict[str, Any]] = []
    for key in per_rank[0]:
        shape, config = _case(key)
        results = [r[key] for r in per_rank]
        step = {k: slowest_per_rep(results, k) for k, _ in VARIANTS}
        s = shapes[shape]
        for name, suffix in CADENCE_ROWS:
            what = f"{s['layers']} x [Linear({s['dim']}) + GELU] + head, batch {s['batch']}"
            rows.append(
                timed_row(f"{shape} {config}{suffix}", step, mine=name, ref="torch",
                          ref_b="torch_b", target=TIME_TARGET, what=what)
            )  # fmt: skip
    # Memory: a fresh process tree per implementation (the A/A runs torch twice).
    mem = {
        name: launch_ranks(
            fsdp.rss_body, impl, shapes, mem_steps, world=world, timeout=900, env=MEMORY_ENV
        )
        for name, impl in VARIANTS
    }
    gpu = device_and_backend(world)[0] == "cuda"
    for key in mem["cadence"][0]:
        shape, config = _case(key)
        per = {k: [floor_page(r[key]) for r in v] for k, v in mem.items()}  # per rank
        for name, suffix in CADENCE_ROWS:
            case = f"{shape} {config}{suffix}"
            rows.append(memory_row(case, per, name, gpu=gpu, target=MEMORY_TARGET))
    return make_record(
        "fsdp",
        quick=quick,
        rows=rows,
        load_before=load0,
        settings={"world": world, "backend": device_and_backend(world)[1], "warmup": warmup,
                  "reps": reps, "memory_steps": mem_steps, "optimizer": "SGD",
                  "threads_per_rank": 1},
    )  # fmt: skip
