"""Rank bodies: cadence.fully_shard takes FSDP2's arguments and setters, each with its effect.

Each section returns what it observed: distances to torch FSDP2 and to a reference
loop, collective counts and dtypes, and what each refused argument raised (as text,
`tests._outcome.raised`); ``test_fsdp2_surface`` holds the expectations.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.tensor import DTensor, Shard

import cadence
from cadence.fsdp import fully_shard
from cadence.testing import max_abs_diff, run_subtests
from tests._outcome import raised
from tests.fsdp.bodies_parity import _Counter
from tests.fsdp.common import (
    apply_cadence,
    apply_torch,
    full_params,
    loss_fn,
    make_batches,
    make_blocks,
    reference_steps,
    train_steps,
)

__all__ = ["fsdp2_surface"]


def _mesh_parity(rank: int, world: int) -> dict[str, Any]:
    """mesh= (FSDP2's spelling) against torch FSDP2 on the same mesh: params and counts."""
    mesh = init_device_mesh("cpu", (world,))
    batches = make_batches("blocks", 2, 8)
    ref = reference_steps(make_blocks(), batches)
    out: dict[str, Any] = {}
    for impl in ("cadence", "fsdp2"):
        m = make_blocks()
        log = cadence.EventLog()
        with _Counter() as counter:
            if impl == "cadence":
                for u in m.units():
                    fully_shard(u, mesh=mesh, event_log=log)
                fully_shard(m, mesh=mesh, event_log=log)
            else:
                apply_torch(m, m.units())
            train_steps(m, batches, rank, world)
            counts = (
                (log.count("all_gather"), log.count("reduce_scatter"))
                if impl == "cadence"
                else counter.take()
            )
        out[f"{impl}_counts"] = counts
        out[f"{impl}_parity"] = max_abs_diff(full_params(m), ref)
    return out


def _torch_mp(rank: int, world: int) -> dict[str, Any]:
    """torch's MixedPrecisionPolicy: same result as cadence's policy and as FSDP2's.

    FSDP2 gets the same explicit policy: with ``reduce_dtype`` unset its reduce dtype
    depends on the torch version (``bodies_torch_checks`` covers that default).
    """
    batches = make_batches("blocks", 2, 8)
    runs = {}
    wire: set[str] = set()
    for impl in ("torch_policy", "cadence_policy", "fsdp2"):
        m = make_blocks()
        log = cadence.EventLog()
        if impl == "fsdp2":
            mp = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            apply_torch(m, m.units(), mp_policy=mp)
        else:
            policy: Any = (
                TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                if impl == "torch_policy"
                else cadence.MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32
                )
            )
            apply_cadence(m, m.units(), mp_policy=policy, event_log=log)
        train_steps(m, batches, rank, world)
        if impl == "torch_policy":
            wire = {f"{e.kind}:{e.dtype}" for e in log.collectives()}
        runs[impl] = full_params(m)
    return {
        "torch_vs_cadence_policy": max_abs_diff(runs["torch_policy"], runs["cadence_policy"]),
        "torch_policy_vs_fsdp2": max_abs_diff(runs["torch_policy"], runs["fsdp2"]),
        "wire": sorted(wire),
    }


def _arguments(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    out["mesh_and_group"] = raised(
        lambda: fully_shard(make_blocks(), mesh=mesh, group=dist.group.WORLD)
    )
    out["mesh_type"] = raised(lambda: fully_shard(make_blocks(), mesh=dist.group.WORLD))
    out["cpu_offload"] = raised(
        lambda: fully_shard(make_blocks(), offload_policy=CPUOffloadPolicy())
    )
    m = fully_shard(make_blocks(), offload_policy=OffloadPolicy())
    out["no_offload_ok"] = float(isinstance(m.head.weight, DTensor))
    out["raf_int"] = raised(lambda: fully_shard(make_blocks(), reshard_after_forward=2))
    out["placement_dim1"] = raised(
        lambda: fully_shard(make_blocks(), shard_placement_fn=lambda p: Shard(1))
    )
    m = fully_shard(make_blocks(), shard_placement_fn=lambda p: Shard(0))
    out["placement_dim0_ok"] = float(isinstance(m.head.weight, DTensor))
    out["dp_mesh_dims"] = raised(lambda: fully_shard(make_blocks(), dp_mesh_dims=object()))
    out["other_offload"] = raised(lambda: fully_shard(make_blocks(), offload_policy=object()))
    m = fully_shard(make_blocks())
    y = loss_fn(m, torch.randn(2, 16))
    # Recorded from a hook: raising there would abort the backward.
    out["all_reduce_in_backward"] = "the hook did not run"
    y.register_hook(
        lambda g: out.__setitem__(
            "all_reduce_in_backward", raised(lambda: m.set_requires_all_reduce(False))
        )
    )
    y.backward()
    out["bad_mp"] = raised(lambda: fully_shard(make_blocks(), mp_policy="bf16"))
    # ignored_params: left a plain parameter; its gradient stays local.
    m = make_blocks()
    log = cadence.EventLog()
    fully_shard(m, ignored_params={m.head.weight}, event_log=log)
    x = make_batches("blocks", 1, 8)[0].chunk(world)[rank]
    loss_fn(m, x).backward()
    g = m.head.weight.grad
    everyone = [torch.empty_like(g) for _ in range(world)]
    dist.all_gather(everyone, g)
    out["ignored_is_plain"] = float(not isinstance(m.head.weight, DTensor))
    out["ignored_grad_spread"] = float((everyone[0] - everyone[1]).abs().max())
    out["ignored_others_sharded"] = float(isinstance(m.head.bias, DTensor))
    # reshard_after_forward=False on the units: backward re-gathers nothing.
    counts = {}
    for raf in (True, False):
        m = make_blocks()
        log = cadence.EventLog()
        apply_cadence(m, m.units(), unit_raf=raf, event_log=log)
        loss_fn(m, x).backward()
        counts[raf] = log.count("all_gather")
    out["ag_raf_true"], out["ag_raf_false"] = counts[True], counts[False]
    return out


def _is_last_backward(rank: int, world: int) -> dict[str, Any]:
    """set_is_last_backward(False): reductions stay in flight until the last backward."""
    batches = make_batches("blocks", 2, 8)
    ref = reference_steps(make_blocks(), batches)
    m = make_blocks()
    log = cadence.EventLog()
    apply_cadence(m, m.units(), event_log=log)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    guard = m.register_optimizer(opt)
    out: dict[str, Any] = {"rs_per_micro": []}
    for batch in batches:
        for i, mb in enumerate(batch.chunk(world)[rank].chunk(2)):
            m.set_is_last_backward(i == 1)
            log.clear()
            (loss_fn(m, mb) / 2).backward()
            out["rs_per_micro"].append(log.count("reduce_scatter"))
            if i == 0:
                out["grad_early"] = type(m.head.weight.grad._local_tensor).__name__
                out["step_early"] = raised(opt.step)
        opt.step()
        opt.zero_grad()
    guard.remove()
    out["parity"] = max_abs_diff(full_params(m), ref)
    return out


def fsdp2_surface() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    sections = {
        "mesh": _mesh_parity,
        "torch_mp": _torch_mp,
        "arguments": _arguments,
        "is_last_backward": _is_last_backward,
    }
    results = run_subtests({"name": list(sections)}, lambda name: sections[name](rank, world))
    return {name: results[f"name={name!r}"] for name in sections}
