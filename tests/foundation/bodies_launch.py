"""Rank bodies for the launcher tests: results, environment, and each way a rank can fail."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

import cadence


def raise_on_rank1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    # Rank 0 blocks in a collective that rank 1 never joins: the launcher must stop it.
    t = torch.zeros(1)
    dist.all_reduce(t)


def exit_on_rank1() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.zeros(1))


def hang_forever() -> None:
    if dist.get_rank() == 0:
        time.sleep(3600)
    dist.all_reduce(torch.zeros(1))


def write_pid_then_hang(path: str) -> None:
    with open(f"{path}.{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)


def env_and_threads() -> dict[str, Any]:
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "env_rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
        # cadence.init() after the launcher initialised: reuses the default group.
        "init_world": cadence.init().world_size,
    }


def identity() -> dict[str, Any]:
    """Where and how this rank runs: its environment, folder, session and parent."""
    return {
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "pid": os.getpid(),
        "sid": os.getsid(0),
        "parent": os.getppid(),
    }


def say(word: str) -> None:
    import sys

    print(f"{word} from rank {dist.get_rank()}", flush=True)
    if dist.get_rank() == 1:
        print(f"{word} on stderr from rank 1", file=sys.stderr, flush=True)


def chatter(lines: int) -> None:
    """Both ranks print at once, after a barrier, so that their lines would interleave."""
    import sys

    rank = dist.get_rank()
    dist.barrier()
    for i in range(lines):
        print(f"rank {rank} line {i} " + "x" * 40)
        print(f"rank {rank} err {i} " + "y" * 40, file=sys.stderr)


def say_and_return(word: str) -> int:
    say(word)
    return dist.get_rank()
