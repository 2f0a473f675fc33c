"""What the scale tests read: one wrapper, one fake world, every figure at once.

Each function builds the wrapper twice in the same fake world (the first build and
its step warm imports and caches, see [Note: counting Python operations]) and then
measures the second: Python operations and collectives of the construction and of
two training steps, and the bytes a rank holds for parameters, gradients, buffers
and the wrapper's own bookkeeping.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cadence.comm import EventLog
from cadence.data_parallel import DataParallel
from cadence.fsdp import fully_shard
from tests.scale._fake_world import (
    Counts,
    batch,
    count_operations,
    fake_world,
    model,
    storage_bytes,
)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2  # the first step runs the lazy set-up, the second is the steady state


def _collectives(log: EventLog) -> list[tuple[str, int]]:
    """(kind, bytes) of each collective in issue order; the log is cleared."""
    out = [(e.kind, e.nbytes) for e in log.collectives()]
    log.clear()
    return out


def _stepper(net: nn.Module) -> Callable[[], None]:
    x = batch()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def step() -> None:
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the gradients: their bytes are measured

    return step


def _measure(build: Callable[[EventLog], nn.Module], world: int) -> dict[str, Any]:
    with fake_world(world):
        warm = build(EventLog())
        warm_step = _stepper(warm)
        for _ in range(STEPS):
            warm_step()
        del warm, warm_step

        log = EventLog()
        init_ops, net = count_operations(lambda: build(log))
        out: dict[str, Any] = {"init_ops": init_ops, "init_collectives": _collectives(log)}
        out["params_bytes"] = storage_bytes(p for p in net.parameters())
        out["buffers_bytes"] = storage_bytes(b for b in net.buffers())
        step = _stepper(net)
        step_ops: list[Counts] = []
        step_collectives: list[list[tuple[str, int]]] = []
        for _ in range(STEPS):
            ops, _ = count_operations(step)
            step_ops.append(ops)
            step_collectives.append(_collectives(log))
        out["step_ops"] = step_ops
        out["step_collectives"] = step_collectives
        out["grads_bytes"] = storage_bytes(p.grad for p in net.parameters())
        out["params_bytes_after_step"] = storage_bytes(p for p in net.parameters())
        out["buffers_bytes_after_step"] = storage_bytes(b for b in net.buffers())
        out.update(_bookkeeping(net))
        return out


def _bookkeeping(net: nn.Module) -> dict[str, Any]:
    if isinstance(net, DataParallel):
        buckets = net._reducer.buckets
        return {
            "buckets": len(buckets),
            "bucket_bytes": sum(b.buffer.untyped_storage().nbytes() for b in buckets),
        }
    units = net._units(recurse=True)  # type: ignore[operator]
    return {
        "units": len(units),
        "shard_numel": [u.shard_numel for u in units],
        "flat_shard_bytes": sum(u.flat_shard.untyped_storage().nbytes() for u in units),
        # Between steps the gathered parameters are freed (storage resized to 0).
        "unsharded_bytes_at_rest": sum(u.unsharded_flat.untyped_storage().nbytes() for u in units),
    }


def fully_shard_figures(world: int) -> dict[str, Any]:
    def build(log: EventLog) -> nn.Module:
        net = model()
        for block in list(net)[:2]:
            fully_shard(block, event_log=log)
        return fully_shard(net, event_log=log)

    return _measure(build, world)


def data_parallel_figures(world: int) -> dict[str, Any]:
    return _measure(lambda log: DataParallel(model(), event_log=log), world)


def model_bytes() -> dict[str, int]:
    net = model()
    return {
        "params": sum(p.numel() * p.element_size() for p in net.parameters()),
        "buffers": sum(b.numel() * b.element_size() for b in net.buffers()),
    }


KINDS = {"fully_shard": fully_shard_figures, "data_parallel": data_parallel_figures}


def figures_by_world(kind: str, worlds: tuple[int, ...], timeout: float) -> dict[int, Any]:
    """`KINDS[kind]` at each world, each in a fresh process of its own.

    A fresh process per world starts every world from the same state: torch's
    caches, which outlive a destroyed process group, hold nothing of another world,
    and the fake group never touches pytest's process.
    """
    with tempfile.TemporaryDirectory() as tmp:
        procs = {
            w: subprocess.Popen(
                [sys.executable, "-m", "tests.scale._measure", kind, str(w), f"{tmp}/{w}.pkl"],
                cwd=ROOT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            for w in worlds
        }
        try:
            for w, proc in procs.items():
                assert proc.wait(timeout=timeout) == 0, (kind, w, proc.returncode)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return {w: pickle.loads(Path(f"{tmp}/{w}.pkl").read_bytes()) for w in worlds}


if __name__ == "__main__":
    torch.set_num_threads(1)
    _, which, world_arg, out_path = sys.argv
    Path(out_path).write_bytes(pickle.dumps(KINDS[which](int(world_arg))))
