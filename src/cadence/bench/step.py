"""``cadence bench step``: whole training steps (forward, backward, optimizer) against torch.

`cadence bench dp` times forward and backward, where DataParallel does what DDP does.
What caller-owned timing buys shows only in a whole step: work that runs while
communication is in flight. Each case holds, in the same rank processes, stepped
interleaved (see [Note: interleaving] in ``_loop.py``):

- ``plain``: the same model and per-rank batch with no wrapper and no communication:
  the step time with communication removed, the limit any overlap approaches;
- ``cadence``: cadence's wrapper with its overlap;
- ``cadence_sync``: cadence's wrapper stepped as torch steps (no overlap): what the
  overlap itself gains, apart from the wrapper;
- ``torch`` and ``torch_b``: torch's own wrapper, stepped after backward (A/A).

Cases:

- ``dense_adamw``: 12 x Linear(512) with AdamW; ``cadence`` is DataParallel with
  `DataParallel.overlap_optimizer`, so each bucket's parameters are stepped while later
  buckets are still reducing; torch is DDP + ``opt.step()`` (target <= 0.85).
- ``fsdp_adamw``: the same model sharded, one unit per block plus the root; ``cadence``
  is fully_shard with ``overlap_optimizer`` (each unit's shards stepped once its
  reduce-scatter is waited, later units still reducing); torch is FSDP2 +
  ``opt.step()`` (target <= 0.50).
- ``recommender``: an ``EmbeddingBag(sparse=True)`` outside the wrapper feeding a dense
  tower; ``cadence`` finalizes manually and runs the sparse half (its all-reduce on a
  second group and its SGD step) while the dense buckets are in flight, as
  ``examples/overlap_sparse.py``; torch runs the sparse half after DDP's backward
  (target <= 0.80).

Reported per case: step time ratio and A/A, and in ``extra`` each variant's step time
as a multiple of ``plain`` (``limit_*``: 1.00 would mean communication fully hidden).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any, cast

from cadence.bench._loop import (
    device_and_backend,
    interleave,
    launch_ranks,
    loadavg,
    rank_device,
    slowest_per_rep,
)
from cadence.bench._record import make_record, timed_row

__all__ = ["CASES", "rank_body", "run"]

VARIANTS = ("plain", "cadence", "cadence_sync", "torch", "torch_b")

CASES: dict[str, dict[str, Any]] = {
    "dense_adamw": {"what": "12 x [Linear(512) + GELU] + Linear(512, 1), AdamW, batch 128/rank",
                    "kind": "dense", "layers": 12, "width": 512, "batch": 128, "target": 0.85},
    "fsdp_adamw": {"what": "12 x [Linear(512) + GELU] + Linear(512, 1), a unit per block, "
                           "AdamW, batch 128/rank",
                   "kind": "fsdp", "layers": 12, "width": 512, "batch": 128, "target": 0.50},
    "recommender": {"what": "EmbeddingBag(200000 x 64, sparse) + 6 x Linear(512) tower, "
                            "SGD, batch 256/rank, bags of 16",
                    "kind": "recommender", "vocab": 200_000, "dim": 64, "layers": 6,
                    "width": 512, "batch": 256, "bag": 16, "target": 0.80},
}  # fmt: skip
TINY: dict[str, dict[str, Any]] = {
    "dense_adamw": {"what": "tiny", "kind": "dense", "layers": 2, "width": 16, "batch": 4,
                    "target": 0.85},
    "fsdp_adamw": {"what": "tiny", "kind": "fsdp", "layers": 2, "width": 16, "batch": 4,
                   "target": 0.50},
    "recommender": {"what": "tiny", "kind": "recommender", "vocab": 64, "dim": 4, "layers": 2,
                    "width": 16, "batch": 4, "bag": 3, "target": 0.80},
}  # fmt: skip
BUCKET_CAP_MB = 1.0


def _tower(layers: int, width: int, d_in: int) -> Any:
    from torch import nn

    mods: list[nn.Module] = [nn.Linear(d_in, width), nn.GELU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*mods, nn.Linear(width, 1))


def _ddp(model: Any, device: str) -> Any:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    kw: dict[str, Any] = {"bucket_cap_mb": BUCKET_CAP_MB}
    if device != "cpu":
        kw["device_ids"] = [torch.cuda.current_device()]
    return DDP(model, **kw)


def _dense_steps(spec: dict[str, Any], rank: int, device: str) -> dict[str, Callable[[], None]]:
    """One closure per variant: zero_grad, forward, backward, AdamW step."""
    import torch

    from cadence.data_parallel import DataParallel

    torch.manual_seed(0)
    base = _tower(spec["layers"] - 1, spec["width"], spec["width"]).to(device)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(spec["batch"], spec["width"], generator=g).to(device)
    models = {
        "plain": copy.deepcopy(base),
        "cadence": DataParallel(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB),
        "cadence_sync": DataParallel(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB),
        "torch": _ddp(copy.deepcopy(base), device),
        "torch_b": _ddp(copy.deepcopy(base), device),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    models["cadence"].overlap_optimizer(opts["cadence"])

    def step(k: str) -> None:
        opts[k].zero_grad(set_to_none=True)
        models[k](x).float().pow(2).mean().backward()
        opts[k].step()

    return {k: functools.partial(step, k) for k in VARIANTS}


def _sharded(impl: str, base: Any, device: str) -> Any:
    """``base`` with one unit per Linear block and the root, by cadence or torch FSDP2."""
    import torch.distributed as dist
    from torch import nn

    model = copy.deepcopy(base)
    blocks = [m for m in model if isinstance(m, nn.Linear)][:-1]
    if impl == "cadence":
        from cadence.fsdp import fully_shard

        for b in blocks:
            fully_shard(b)
        return fully_shard(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh(device.split(":")[0], (dist.get_world_size(),))
    for b in blocks:
        torch_fully_shard(b, mesh=mesh)
    return torch_fully_shard(model, mesh=mesh)


def _fsdp_steps(spec: dict[str, Any], rank: int, device: str) -> dict[str, Callable[[], None]]:
    """One closure per variant: zero_grad, forward, backward, AdamW step, sharded."""
    import torch

    torch.manual_seed(0)
    base = _tower(spec["layers"] - 1, spec["width"], spec["width"]).to(device)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(spec["batch"], spec["width"], generator=g).to(device)
    models = {"plain": copy.deepcopy(base)}
    for k in VARIANTS[1:]:
        models[k] = _sharded("cadence" if k.startswith("cadence") else "torch", base, device)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    models["cadence"].overlap_optimizer(opts["cadence"])

    def step(k: str) -> None:
        opts[k].zero_grad(set_to_none=True)
        models[k](x).float().pow(2).mean().backward()
        opts[k].step()

    return {k: functools.partial(step, k) for k in VARIANTS}


def _recommender_steps(
    spec: dict[str, Any], rank: int, device: str
) -> dict[str, Callable[[], None]]:
    """Sparse embedding outside the wrapper, dense tower inside; SGD on both."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from cadence.comm import Comm
    from cadence.data_parallel import DataParallel

    torch.manual_seed(0)
    bag = nn.EmbeddingBag(spec["vocab"], spec["dim"], mode="mean", sparse=True).to(device)
    tower = _tower(spec["layers"], spec["width"], spec["dim"]).to(device)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["bag"]), generator=g).to(device)
    # Every variant's sparse exchange runs on its own group, so it never queues behind
    # the dense buckets still in flight on the wrappers' group.
    # Every rank is a member (no ranks=), so new_group returns a ProcessGroup.
    sparse_group = cast(
        dist.ProcessGroup, dist.new_group(backend="gloo" if device == "cpu" else None)
    )
    sparse_comm = Comm(sparse_group, name="sparse")
    bags = {k: copy.deepcopy(bag) for k in VARIANTS}
    towers: dict[str, Any] = {"plain": copy.deepcopy(tower)}
    for k in ("cadence", "cadence_sync"):
        towers[k] = DataParallel(copy.deepcopy(tower), bucket_cap_mb=BUCKET_CAP_MB)
    towers["cadence"].require_manual_backward_finalization = True
    for k in ("torch", "torch_b"):
        towers[k] = _ddp(copy.deepcopy(tower), device)
    dense_opts = {k: torch.optim.SGD(t.parameters(), lr=1e-3) for k, t in towers.items()}
    sparse_opts = {k: torch.optim.SGD(b.parameters(), lr=1e-3) for k, b in bags.items()}

    def sparse_half(k: str) -> None:
        grad = bags[k].weight.grad
        if k != "plain":
            assert grad is not None  # the backward just before wrote it
            sparse_comm.all_reduce(grad, op="avg")
        sparse_opts[k].step()

    def step(k: str) -> None:
        dense_opts[k].zero_grad(set_to_none=True)
        sparse_opts[k].zero_grad(set_to_none=True)
        towers[k](torch.tanh(bags[k](ids))).float().pow(2).mean().backward()
        # cadence: backward only launched the dense buckets; the sparse half runs while
        # they are in flight, then finalize. Everyone else: backward already waited.
        sparse_half(k)
        if k == "cadence":
            towers[k].finalize_backward()
        dense_opts[k].step()

    return {k: functools.partial(step, k) for k in VARIANTS}


def rank_body(cases: dict[str, dict[str, Any]], warmup: int, reps: int) -> dict[str, Any]:
    import torch.distributed as dist

    rank, device = dist.get_rank(), rank_device()
    out: dict[str, Any] = {}
    for name, spec in cases.items():
        build = {"dense": _dense_steps, "fsdp": _fsdp_steps}.get(spec["kind"], _recommender_steps)
        steps = build(spec, rank, device)
        out[name] = interleave(steps, warmup=warmup, reps=reps)
        del steps
    return out


def run(*, quick: bool, tiny: bool = False, world: int = 2) -> dict[str, Any]:
    """Run the comparison and return its record (not yet written)."""
    from cadence.bench import step

    cases = TINY if tiny else CASES
    warmup, reps = (1, 2) if tiny else (3, 12) if quick else (5, 40)
    load0 = loadavg()
    per_rank = launch_ranks(step.rank_body, cases, warmup, reps, world=world, timeout=1800)
    rows = []
    for name, spec in cases.items():
        results = [r[name] for r in per_rank]
        t = {k: slowest_per_rep(results, k) for k in VARIANTS}
        plain = sorted(t["plain"])[len(t["plain"]) // 2]
        extra = {
            f"limit_{k}": sorted(t[k])[len(t[k]) // 2] / plain
            for k in ("cadence", "cadence_sync", "torch")
        }
        rows.append(
            timed_row(name, t, mine="cadence", ref="torch", ref_b="torch_b",
                      target=spec["target"], what=spec["what"], extra=extra)
        )  # fmt: skip
    return make_record(
        "step",
        quick=quick,
        rows=rows,
        load_before=load0,
        settings={"world": world, "backend": device_and_backend(world)[1], "warmup": warmup,
                  "reps": reps, "bucket_cap_mb": BUCKET_CAP_MB, "threads_per_rank": 1},
    )  # fmt: skip
