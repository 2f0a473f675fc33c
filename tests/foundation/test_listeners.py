"""cadence's ranks listen on the addresses their job needs, not on every interface.

Specification (see [Note: the attempt store binds one address] and [Note: a local
launch listens on loopback]):
- every socket a `cadence.launch` rank listens on (gloo's pairs) is on loopback, and
  the ranks' environment names the loopback interface for gloo unless the caller
  named another;
- under torchrun's agent store with ``MASTER_ADDR=localhost`` (one machine), the attempt
  store rank 0 publishes is on loopback, and the kernel lists its port as listening on
  loopback only, not on the wildcard address;
- the address is the source of the route to ``MASTER_ADDR``, so a name that does not
  resolve is refused with the variable to fix, before any store is made.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cadence._groups.dist_init import _route_address
from cadence.errors import CadenceRuntimeError
from cadence.launch import launch

ROOT = Path(__file__).resolve().parents[2]

# One rank under a stand-in for torchrun's agent store: cadence.init() must take the
# attempt-store path, then the test reads where that store listens from the kernel.
_SCRIPT = r"""
import os, socket
from datetime import timedelta
import torch
import torch.distributed as dist
torch.set_num_threads(1)
agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=20))
os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(agent.port), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0", TORCHELASTIC_USE_AGENT_STORE="True")
import cadence
cadence.init(backend="gloo", timeout=20)
host, port = agent.get("cadence/attempt-store").decode().rsplit(":", 1)
listening = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    if not os.path.exists(table):
        continue
    for line in open(table).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hexport = local.rsplit(":", 1)
        if state == "0A" and int(hexport, 16) == int(port):  # 0A: LISTEN
            listening.add(addr)
print(host, sorted(listening))
dist.destroy_process_group()
"""


def _listening_addresses() -> list[str]:
    """Local addresses (as /proc spells them) of the TCP sockets this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        target = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN; column 9: inode
                found.append(cols[1].rsplit(":", 1)[0])
    return found


def _rank_listeners() -> dict[str, object]:
    import torch.distributed as dist

    dist.barrier()  # every pair is connected: gloo has bound its sockets
    return {"ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "listening": _listening_addresses()}


_LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1
_SKIP_NO_PROC = pytest.mark.skipif(
    not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket table"
)


@_SKIP_NO_PROC
def test_a_local_launch_listens_on_loopback_only() -> None:
    for out in launch(_rank_listeners, nprocs=2, timeout=60, num_threads=1):
        assert out["ifname"] in ("lo", "lo0")
        assert out["listening"] and set(out["listening"]) <= _LOOPBACK, out


def _gloo_ifname() -> str | None:
    return os.environ.get("GLOO_SOCKET_IFNAME")


def test_an_interface_the_caller_names_wins() -> None:
    env = {"GLOO_SOCKET_IFNAME": "ib7"}  # no group is made: the name need not exist
    (named,) = launch(_gloo_ifname, nprocs=1, timeout=60, env=env, init_process_group=False)
    assert named == "ib7"


@_SKIP_NO_PROC
def test_the_attempt_store_listens_on_loopback_only_on_one_machine() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    host, listening = proc.stdout.strip().split(" ", 1)
    assert host in ("127.0.0.1", "::1")
    # /proc lists 127.0.0.1 as 0100007F; the wildcard would be 00000000 (or all-zero v6).
    wildcard = {"00000000", "0" * 32}
    assert listening != "[]" and not any(w in listening for w in wildcard), listening


def test_the_store_address_is_the_route_to_master_addr() -> None:
    assert _route_address("localhost") in ("127.0.0.1", "::1")
    assert _route_address("127.0.0.1") == "127.0.0.1"
    with pytest.raises(CadenceRuntimeError, match=r"MASTER_ADDR='no-such-host\.invalid'"):
        _route_address("no-such-host.invalid")
