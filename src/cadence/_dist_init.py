"""`cadence.init()`: from the torchrun environment to a `ParallelGroups`."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from cadence.topology import ParallelGroups, Topology

__all__ = ["init"]


def init(
    topology: Topology | None = None,
    *,
    backend: str | None = None,
    timeout: float | timedelta = 600.0,
) -> ParallelGroups:
    """Initialise torch.distributed from the environment and build the topology's groups.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
    (as set by torchrun or `cadence.launch`). Without them it starts a world of one,
    so the same script runs on a laptop. Picks NCCL when CUDA is available and gloo
    otherwise, and binds this rank to its local GPU.

    Args:
        topology: parallel degrees; default plain data parallel over the whole world.
        backend: override the backend choice ("gloo", "nccl", "cpu:gloo,cuda:nccl").
        timeout: collective timeout in seconds; it is the backstop against hangs.
    """
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=float(timeout))
    if not dist.is_initialized():
        use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
        chosen = backend or ("nccl" if use_cuda else "gloo")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device_id = None
        if use_cuda:
            torch.cuda.set_device(local_rank)
            device_id = torch.device("cuda", local_rank)
        init_method = os.environ.get("CADENCE_INIT_METHOD")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if init_method is None and restart is not None and "RANK" in os.environ:
            _init_restart_scoped(chosen, int(restart), timeout, device_id)
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(
                chosen,
                init_method=init_method or "env://",
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timeout,
                device_id=device_id,
            )
        else:
            # A world of one: no rendezvous needed, so no port can collide.
            dist.init_process_group(
                chosen,
                store=dist.HashStore(),
                rank=0,
                world_size=1,
                timeout=timeout,
                device_id=device_id,
            )
    world = dist.get_world_size()
    topology = topology or Topology.data_parallel(world)
    topology.validate(world)
    return topology.build()


def _init_restart_scoped(
    backend: str, restart: int, timeout: timedelta, device_id: torch.device | None
) -> None:
    """Under torchrun: the default group on a store scoped to this restart attempt.

    [Note: one store per restart attempt]
    torchrun's agent keeps its rendezvous store across restarts of the workers, and
    ``init_process_group`` writes every rank's address under the same keys each time.
    The workers of a new attempt can then read the addresses the dead attempt left
    and dial ports that no longer exist ("connectFullMesh ... Connection refused") or
    wait on keys that are already set. Prefixing the store with the attempt number
    (``TORCHELASTIC_RESTART_COUNT``, the same on every worker of an attempt) gives
    each attempt keys no earlier attempt wrote.
    """
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"cadence/attempt-{restart}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=device_id,
    )
