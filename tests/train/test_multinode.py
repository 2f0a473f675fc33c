"""Several nodes on one machine: one ``torchrun`` agent per emulated node.

Each node is an agent with its own loopback address (``--local-addr 127.0.0.N``), all
meeting at a c10d rendezvous on 127.0.0.1 (host loopback only; nothing else is ever
addressed). Specification:
- two nodes of one worker each train ``cadence train`` (DataParallel) with the losses
  of a one-node run of the same world and global batch, bit for bit; so do HSDP on two
  nodes of two (replicas across the nodes, shards inside) and the 3-D layout on two
  nodes of four (one pipeline stage per node, HSDP inside it), whose first lines say
  which axes cross the nodes (`cadence.train.placement`);
- a node killed whole (its agent and every process under it get SIGKILL) after a checkpoint and
  started again 2 s later rejoins with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (as
  ``docs/multinode.md`` says); the run resumes from the last complete checkpoint and
  its losses equal the uninterrupted run's bit for bit;
- a node killed whole that never returns, in an elastic job (1 to 2 nodes) under
  fully_shard: the other node's agent restarts its worker alone after a short last
  call, the run resumes at world 1 from the checkpoint (resharded on load), and every
  loss is within 1e-4 of an uninterrupted two-rank run of the same global batch;
- without that setting, a job with restarts across nodes is refused at its start, in
  one line naming the variable (`cadence.train.preflight.torchrun_rejoin_problem`);
- two nodes inside an emulated link (`cadence.link`) whose link is slowed 100x and then
  cut for 3 s mid-run finish with the losses of an uninterrupted run, bit for bit;
- a worker that stops answering on one node (SIGSTOP) ends the job on both nodes, and
  the other node's error names it (rank 1) beside the collective that timed out.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cadence.cli import main
from cadence.link import EmulatedLink, LinkSpec
from tests.link._available import unavailable

# Tens of seconds of torchrun agents, alike on every torch lane: see [Note: costly
# launcher tests run on the other lane only] in tests/conftest.py.
pytestmark = pytest.mark.other_lane
ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--batch-size", "8", "--d-model", "16", "--layers", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(*, share_store: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_"))}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return env


def _node(
    n: int,
    port: int,
    argv: list[str],
    log: Path,
    *,
    restarts: int,
    share_store: bool = False,
    nnodes: str = "2",
    rdzv_conf: str = "",
    link: EmulatedLink | None = None,
    per_node: int = 1,
) -> subprocess.Popen[bytes]:
    """Node ``n``'s agent (address 127.0.0.n), in a session of its own: killing its
    process group kills the agent and its worker, as a node that dies. With ``link``,
    the agent runs inside that emulated link's namespace."""
    conf = ["--rdzv-conf", rdzv_conf] if rdzv_conf else []
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", nnodes, "--nproc-per-node", str(per_node), *conf,
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "cadence-test", "--local-addr", f"127.0.0.{n}",
        "--max-restarts", str(restarts),
        "-m", "cadence", "train", *argv,
    ]  # fmt: skip
    return subprocess.Popen(
        link.command(cmd) if link else cmd,
        env=_env(share_store=share_store),
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _nodes(
    port: int, argv: list[str], logs: list[Path], *, restarts: int, **node: Any
) -> list[subprocess.Popen[bytes]]:
    """Node 2, then node 3 once node 2's agent listens: node 2 hosts the rendezvous's
    store (both addresses are this machine's, so either agent could), and a test that
    kills node 3 kills a node without the store, as a cluster's worker node."""
    first = _node(2, port, argv, logs[0], restarts=restarts, **node)
    deadline = time.monotonic() + 60
    while not _listening(port, node.get("link")):
        assert first.poll() is None and time.monotonic() < deadline, logs[0].read_text()[-2000:]
        time.sleep(0.05)
    return [first, _node(3, port, argv, logs[1], restarts=restarts, **node)]


def _listening(port: int, link: EmulatedLink | None) -> bool:
    """Whether 127.0.0.1:port accepts, on the host or inside ``link``'s namespace."""
    if link is None:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)"
    out = subprocess.run(link.command([sys.executable, "-c", probe]), capture_output=True)
    return out.returncode == 0


def _wait(procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        text = "\n".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for log in logs)
        pytest.fail(f"the agents did not finish within {timeout} s:\n{text}")
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_node(p)


def _tree(agent: subprocess.Popen[bytes]) -> list[int]:
    """The agent's pid and every process under it (torchrun starts its workers in
    sessions of their own, so the agent's process group alone would leave them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [agent.pid], []
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _kill_node(agent: subprocess.Popen[bytes]) -> None:
    """SIGKILL the agent and every process under it."""
    _signal(_tree(agent), signal.SIGKILL)
    agent.wait()


def _losses(run_dir: Path) -> list[float]:
    return json.loads((run_dir / "metrics.json").read_text())["losses"]


def _one_node(tmp: Path, extra: list[str]) -> list[float]:
    assert main(["train", "--nproc", "2", *TRAIN, *extra, "--run-dir", str(tmp)]) == 0
    return _losses(tmp)


def test_two_nodes_train_as_one(tmp_path: Path) -> None:
    run = tmp_path / "two"
    argv = [*TRAIN, "--steps", "3", "--run-dir", str(run)]
    port, logs = _free_port(), [tmp_path / "node2.log", tmp_path / "node3.log"]
    procs = _nodes(port, argv, logs, restarts=0)
    codes = _wait(procs, logs, 150)
    assert codes == [0, 0], "\n".join(log.read_text()[-2000:] for log in logs)
    assert _losses(run) == _one_node(tmp_path / "one", ["--steps", "3"])


@pytest.mark.parametrize(
    ("per_node", "layout", "across", "inside"),
    [
        (2, ["--fsdp", "--dp-replicate", "2"], "replicate (HSDP's", "shard (fully_shard's"),
        (
            4,
            ["--pp", "2", "--fsdp", "--dp-replicate", "2", "--batch-size", "16"],
            "pipeline (activations",
            "replicate (HSDP's gradient all-reduce), shard",
        ),
    ],
    ids=["hsdp", "pipeline_x_hsdp"],
)
def test_layouts_across_two_nodes_train_as_one_node(
    tmp_path: Path, per_node: int, layout: list[str], across: str, inside: str
) -> None:
    """Two nodes: HSDP (two workers each) with its replicas across the nodes and its
    shards inside one; the 3-D layout (four workers each), a two-stage pipeline with one
    stage per node and HSDP inside it. The run says so in its first lines, and its
    losses are a one-node run's, bit for bit."""
    run = tmp_path / "two"
    argv = [*TRAIN, *layout, "--steps", "3", "--run-dir", str(run)]
    port, logs = _free_port(), [tmp_path / "node2.log", tmp_path / "node3.log"]
    procs = _nodes(port, argv, logs, restarts=0, per_node=per_node)
    codes = _wait(procs, logs, 180)
    text = "".join(log.read_text() for log in logs)
    assert codes == [0, 0], text[-4000:]
    placement = next(
        line for line in text.splitlines() if f"placement: 2 nodes of {per_node}" in line
    )
    assert f"across nodes: {across}" in placement, placement
    assert f"inside a node: {inside}" in placement, placement
    assert "span nodes" not in text, text[-4000:]
    one = main(
        [
            "train",
            "--nproc",
            str(2 * per_node),
            *TRAIN,
            *layout,
            "--steps",
            "3",
            "--run-dir",
            str(tmp_path / "one"),
        ]
    )
    assert one == 0
    assert _losses(run) == _losses(tmp_path / "one")


def test_a_killed_node_rejoins_and_the_run_resumes_exactly(tmp_path: Path) -> None:
    run = tmp_path / "two"
    # Many checkpoints: a save takes tens of milliseconds, so the run is still going when
    # node 3 is killed, right after the first checkpoint is complete.
    steps = ["--steps", "40", "--checkpoint-every", "2", "--resume"]
    argv = [*TRAIN, *steps, "--run-dir", str(run)]
    port, logs = _free_port(), [tmp_path / "node2.log", tmp_path / "node3.log"]
    procs = _nodes(port, argv, logs, restarts=2)
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "step-2").is_dir():  # a complete checkpoint exists
        assert time.monotonic() < deadline, logs[0].read_text()[-2000:]
        assert procs[0].poll() is None, logs[0].read_text()[-2000:]
        time.sleep(0.05)
    _kill_node(procs[1])  # node 3 dies whole: agent and worker
    assert not (run / "checkpoints" / "step-40").exists(), "the run ended before the kill"
    time.sleep(2)
    procs[1] = _node(3, port, argv, logs[1], restarts=2)  # ... and comes back
    codes = _wait(procs, logs, 180)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    assert "resumed from step-" in logs[0].read_text(), "the run never restarted"
    want = _one_node(tmp_path / "one", ["--steps", "40"])
    assert _losses(run) == want


def test_a_node_that_never_returns_leaves_the_run_to_the_others(tmp_path: Path) -> None:
    run = tmp_path / "two"
    # An elastic job (1 to 2 nodes) under fully_shard, whose checkpoints are resharded
    # on load: node 3 dies whole after the first checkpoint and never comes back, so
    # node 2's agent restarts its worker alone, at world 1, from that checkpoint.
    steps = ["--steps", "40", "--checkpoint-every", "2", "--resume", "--fsdp"]
    argv = [*TRAIN, *steps, "--run-dir", str(run)]
    port, logs = _free_port(), [tmp_path / "node2.log", tmp_path / "node3.log"]
    # A short last call: once one node is there, the round closes 2 s later.
    procs = _nodes(port, argv, logs, restarts=2, nnodes="1:2", rdzv_conf="last_call_timeout=2")
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "step-2").is_dir():
        assert time.monotonic() < deadline, logs[0].read_text()[-2000:]
        assert procs[0].poll() is None, logs[0].read_text()[-2000:]
        time.sleep(0.05)
    _kill_node(procs[1])
    assert not (run / "checkpoints" / "step-40").exists(), "the run ended before the kill"
    (code,) = _wait(procs[:1], logs, 240)
    text = logs[0].read_text()
    assert code == 0, text[-3000:]
    assert "resumed from step-" in text, "the run never restarted"
    losses = _losses(run)
    assert len(losses) == 40, len(losses)
    # The same global batch at world 1: the same loss up to the order of a sum.
    want = _one_node(tmp_path / "one", ["--steps", "40", "--fsdp"])
    assert max(abs(a - b) for a, b in zip(losses, want, strict=True)) < 1e-4, (losses, want)


def test_restarts_across_nodes_without_the_setting_are_refused(tmp_path: Path) -> None:
    argv = [*TRAIN, "--steps", "2", "--run-dir", str(tmp_path / "run")]
    port, logs = _free_port(), [tmp_path / "node2.log", tmp_path / "node3.log"]
    procs = _nodes(port, argv, logs, restarts=1, share_store=True)
    codes = _wait(procs, logs, 150)
    assert all(c != 0 for c in codes), codes
    text = logs[0].read_text() + logs[1].read_text()
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text, text[-3000:]


def test_a_link_slowed_then_cut_mid_run_is_ridden_out(tmp_path: Path) -> None:
    """Two nodes inside an emulated 1 Gbit/s link. After the first checkpoint the link
    is slowed 100x for 2 s, then cut for 3 s (its loopback down), then restored: the run
    finishes, without a restart or after one from its last checkpoint, and its losses
    equal an uninterrupted run's bit for bit. Skipped, with the reason, where this
    machine cannot make a link."""
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    run = tmp_path / "two"
    steps = ["--steps", "300", "--checkpoint-every", "50", "--resume"]
    argv = [*TRAIN, *steps, "--run-dir", str(run)]
    port, logs = _free_port(), [tmp_path / "node2.log", tmp_path / "node3.log"]
    fast, slow = LinkSpec.parse("1gbit"), LinkSpec.parse("10mbit")
    with EmulatedLink(fast) as link:
        procs = _nodes(port, argv, logs, restarts=2, link=link)
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "step-50").is_dir():
            assert time.monotonic() < deadline, logs[0].read_text()[-2000:]
            assert procs[0].poll() is None, logs[0].read_text()[-2000:]
            time.sleep(0.05)
        link.reshape(slow)
        time.sleep(2)
        link.set_connected(False)
        time.sleep(3)
        link.set_connected(True)
        link.reshape(fast)
        assert not (run / "checkpoints" / "step-300").exists(), "the run ended before the faults"
        codes = _wait(procs, logs, 240)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    assert _losses(run) == _one_node(tmp_path / "one", ["--steps", "300"])


def test_a_rank_hung_on_one_node_stops_the_job_and_is_named(tmp_path: Path) -> None:
    """Node 3's worker stops answering (SIGSTOP: alive, silent) mid-run. Node 2's rank
    times out in its collective within --collective-timeout, and its error names rank 1
    as the one that never reported the same timeout; node 2's agent then ends the job,
    and node 3's agent stops too."""
    run = tmp_path / "two"
    # No checkpoints: node 2's rank is then always blocked inside a training step (whose
    # collectives name the missing rank), never in a checkpoint's object collective.
    steps = ["--steps", "2000", "--collective-timeout", "3"]
    argv = [*TRAIN, *steps, "--run-dir", str(run)]
    port, logs = _free_port(), [tmp_path / "node2.log", tmp_path / "node3.log"]
    procs = _nodes(port, argv, logs, restarts=0)
    deadline = time.monotonic() + 120
    while "step 200/2000" not in logs[0].read_text():  # the run is under way
        assert time.monotonic() < deadline, logs[0].read_text()[-2000:]
        assert procs[0].poll() is None, logs[0].read_text()[-2000:]
        time.sleep(0.05)
    stopped = _tree(procs[1])[1:]  # node 3's worker(s), not its agent
    _signal(stopped, signal.SIGSTOP)
    try:
        codes = _wait(procs, logs, 120)
    finally:
        _signal(stopped, signal.SIGKILL)
    text = logs[0].read_text()
    assert codes[0] != 0 and codes[1] != 0, (codes, text[-3000:])
    assert "error: rank 0 timed out in step" in text, text[-3000:]
    assert "rank(s) [1] had not reported a timeout" in text, text[-3000:]
