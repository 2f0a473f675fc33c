"""`cadence.init()`: from the torchrun environment to a `ParallelGroups`."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from cadence.errors import CadenceRuntimeError
from cadence.topology import ParallelGroups, Topology

__all__ = ["init"]

# Where rank 0 of a torchrun attempt publishes its store; see [Note: one store per
# restart attempt]. Seconds a rank tries one published address before reading again.
_STORE_KEY = "cadence/attempt-store"
_CONNECT_S = 2.0


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
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        if init_method is None and agent_store and "RANK" in os.environ:
            _init_on_fresh_store(chosen, timeout, device_id)
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


def _init_on_fresh_store(backend: str, timeout: timedelta, device_id: torch.device | None) -> None:
    """Under torchrun's shared agent store: the default group on a store of this attempt.

    [Note: one store per restart attempt]
    torchrun's agent keeps one store for the whole job (``TORCHELASTIC_USE_AGENT_STORE``),
    and ``init_process_group`` writes every rank's address under the same keys in every
    attempt. The workers of a restarted attempt can then read the addresses a dead
    attempt left and dial ports that no longer exist ("connectFullMesh ... Connection
    refused") or wait on keys already set. Prefixing the keys with
    ``TORCHELASTIC_RESTART_COUNT`` is not enough: each agent counts its own restarts,
    and an agent that restarts its workers because another node failed does not count,
    so two nodes can disagree on the attempt number.

    So rank 0 of each attempt hosts a new store, which holds no key of an earlier
    attempt, and publishes its address in the agent's store. A rank that reads an
    earlier attempt's address finds nothing listening there (torchrun stops every
    worker of an attempt before the next starts) and reads again until it connects.
    """
    agent, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    if rank == 0:
        host = _route_address(os.environ.get("MASTER_ADDR", "localhost"))
        listener = _listen(host)
        port = listener.getsockname()[1]
        store: dist.Store = dist.TCPStore(
            host,
            port,
            world,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            # The store owns the socket from here (it closes it with the server).
            master_listen_fd=listener.detach(),
        )
        agent.set(_STORE_KEY, f"{host}:{port}")
    else:
        store = _connect_to_attempt_store(agent, world, timeout)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device_id
    )


def _route_address(master: str) -> str:
    """This host's address on the route to ``master``: the one its peers reach it by.

    [Note: the attempt store binds one address]
    ``TCPStore(host, 0, is_master=True)`` listens on every interface of the host, so a
    store meant for the job's own ranks would also answer any network the host is on,
    and its keys (the addresses of every rank) carry no authentication. The store binds
    the one address the job needs instead: the source address of a route to
    ``MASTER_ADDR`` (torchrun's own store, which every rank already reaches). On one
    machine (``--standalone``, ``MASTER_ADDR=localhost``) that is loopback, so nothing
    outside the machine can connect. A UDP ``connect`` sends no packet; it only asks the
    kernel which local address the route would use.
    """
    try:
        infos = socket.getaddrinfo(master, 1, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise CadenceRuntimeError(
            f"cannot resolve MASTER_ADDR={master!r} to pick the address rank 0's store "
            f"binds ({exc}); set MASTER_ADDR to a name or address every node resolves"
        ) from exc
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(addr)
            except OSError:
                continue
            return str(probe.getsockname()[0])
    raise CadenceRuntimeError(
        f"no route from this host to MASTER_ADDR={master!r}, so rank 0's store has no "
        "address its peers could reach; check MASTER_ADDR and the network"
    )


def _listen(host: str) -> socket.socket:
    """A TCP socket listening on ``host`` alone, at a port the kernel picks."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    return listener


def _connect_to_attempt_store(agent: dist.Store, world: int, timeout: timedelta) -> dist.Store:
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        host, port = agent.get(_STORE_KEY).decode().rsplit(":", 1)
        try:
            store = dist.TCPStore(
                host, int(port), world, is_master=False, timeout=timedelta(seconds=_CONNECT_S)
            )
        except (RuntimeError, TimeoutError) as exc:  # an earlier attempt's address
            if time.monotonic() > deadline:
                raise CadenceRuntimeError(
                    f"could not reach rank 0's store at {host}:{port} within {timeout}: {exc}"
                ) from exc
            time.sleep(_CONNECT_S / 4)
            continue
        store.set_timeout(timeout)  # the short timeout was for connecting only
        return store
