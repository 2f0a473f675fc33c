"""Rank bodies of the export tests: train a layout, export, check the file on every rank."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from cadence._groups.dist_init import init
from cadence.models.config import GPTConfig
from cadence.train.build import build_state, topology_for
from cadence.train.config import TrainConfig
from cadence.train.export import WEIGHTS, export_weights
from cadence.train.loop import run_loop

# Four blocks: one per stage up to four stages, and a tied head (exported once).
BASE = TrainConfig(steps=2, batch_size=8, model=GPTConfig(d_model=16, n_layers=4))


def body_export(flags: dict[str, Any], out_dir: str) -> dict[str, torch.Tensor] | None:
    """Train ``BASE`` with ``flags`` on the launched world, export to ``out_dir``, and
    check on every rank that each tensor it holds (gathered, if sharded) equals the
    file's entry of its name, bit for bit. Rank 0 returns the file's tensors."""
    cfg = dataclasses.replace(BASE, nproc=dist.get_world_size(), export=out_dir, **flags)
    pg = init(topology_for(cfg.layout()))
    state = build_state(cfg, pg)
    run_loop(state, cfg.steps, cfg.batch_size)
    assert state.export_plan is not None
    export_weights(state.export_plan, state.modules, pg, out_dir)
    dist.barrier()  # rank 0 has renamed the complete file
    saved = load_file(f"{out_dir}/{WEIGHTS}")
    plan = state.export_plan
    names = [plan.file_name(n) for n, _, _ in plan.entries]
    assert sorted(saved) == sorted(names), f"rank {pg.rank}: file holds {sorted(saved)}"
    held = plan.local(state.modules)
    assert held, f"rank {pg.rank} holds none of the exported tensors"
    for name, t in held.items():
        full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
        got = saved[plan.file_name(name)]
        assert torch.equal(got, full), (
            f"rank {pg.rank} {flags}: '{name}' differs from the trained tensor by "
            f"{(got.float() - full.float()).abs().max():.3e}"
        )
    return saved if pg.rank == 0 else None
