"""The emulated link itself: a network namespace of the run's own, its loopback shaped.

[Note: why a namespace]
On one machine, ranks talk over ``lo``, which moves bytes as fast as the CPU copies
them: communication is CPU work competing with the compute, and overlap has nothing
to hide. Shaping the host's ``lo`` would slow every other program on the machine. A
new network namespace has a loopback of its own (127.0.0.0/8 and nothing else, no
route out), so its ``lo`` can be given a token-bucket rate (``tbf``) and a delay
(``netem``) that only the processes started inside see. Every byte any rank sends
passes that one queue once, in either direction: the ranks share one wire, as the
ranks of a node share its NIC. A kernel without ``sch_netem`` gets its delay from a
user-space delay line instead, where ``iptables`` is installed (see [Note: the delay
line] in ``_delay_line.py``); the self-check's round trip shows the delay either way.

[Note: the namespace is removed on every exit path]
`EmulatedLink` is a context manager: leaving it (normally, by an error, by Ctrl-C,
after a rank was killed) kills whatever still runs inside and deletes the namespace.
A process killed with SIGKILL runs no code, so a namespace can outlive its creator;
its name carries the creator's pid, and the next link made on the machine removes
every ``cadence-link-<pid>-*`` whose pid is gone.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

from cadence.link._errors import LinkUnavailableError
from cadence.link._spec import LinkSpec
from cadence.link._wire import ENV_VAR, ActiveLink

__all__ = ["DELAY_LINE", "PREFIX", "EmulatedLink", "LinkMeasurement", "remove_stale"]

PREFIX = "cadence-link-"
_STALE = re.compile(rf"^{re.escape(PREFIX)}(\d+)-\d+$")
_COUNTER = itertools.count()
# A loopback packet is up to 64 KiB (lo's MTU), and the token bucket must hold at least
# one; more than a few lets a sender burst past the rate.
_MIN_BURST = 256 * 1024
# Queue room before the shaper drops: a drop on loopback costs TCP a 200 ms
# retransmission timeout, which no real link's loss would cost at these round trips.
_QUEUE_BYTES = 64 * 1024 * 1024
_TOOLS = {"ip": "iproute2", "tc": "iproute2"}
DELAY_LINE = "delay line"
_QUEUE = 0  # the netfilter queue of the delay line (each namespace has its own)
_READY_S = 10.0  # how long the delay line may take to bind its queue


@dataclass(frozen=True)
class LinkMeasurement:
    """What the self-check saw: bytes through the link, at what rate, and a round trip."""

    bytes: int
    seconds: float
    rate_bps: float
    rtt_ms: float
    delay_by: str | None = None  # "netem", "delay line" or None (no delay asked)

    def line(self, spec: LinkSpec) -> str:
        asked = spec.describe()
        got = LinkSpec(None).describe() if not spec.shaped else f"{self.rate_bps / 1e9:.3g} Gbit/s"
        ratio = f" ({self.rate_bps / spec.rate_bps:.2f} of it)" if spec.rate_bps else ""
        by = (
            " (delay from a user-space delay line: this kernel has no sch_netem)"
            if self.delay_by == DELAY_LINE
            else ""
        )
        return (
            f"link self-check: asked {asked}; measured {got}{ratio} over "
            f"{self.bytes / 2**20:.0f} MiB, round trip {self.rtt_ms:.2f} ms{by}"
        )


def _run(argv: Sequence[str], what: str) -> str:
    """Run an ``ip``/``tc`` command; a failure names the command and its message."""
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        msg = (done.stderr or done.stdout).strip().splitlines()
        reason = msg[-1] if msg else f"exit {done.returncode}"
        hint = ""
        if "qdisc kind is unknown" in reason:
            kind = next((k for k in ("netem", "tbf") if k in argv), "?")
            hint = f"; this kernel has no `{kind}` queueing discipline (module sch_{kind})" + (
                ", which delay= needs: drop delay=, use a kernel with sch_netem, or install "
                "iptables (Debian/Ubuntu package iptables) for cadence's user-space delay line"
                if kind == "netem"
                else ""
            )
        if "permitted" in reason.lower() or "permission" in reason.lower():
            hint = (
                "; making a network namespace needs CAP_NET_ADMIN and CAP_SYS_ADMIN "
                "(run as root, or give the container --cap-add NET_ADMIN --cap-add SYS_ADMIN)"
            )
        raise LinkUnavailableError(f"{what}: `{' '.join(argv)}` failed: {reason}{hint}")
    return done.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


# [Note: a process that joins as the link is removed]
# ``ip netns exec NAME cmd`` opens the namespace, enters it, then execs ``cmd``. A
# command started just before the link is removed may enter after the last look for
# processes inside and after the name is gone, where ``ip netns pids NAME`` can no
# longer see it, and outlive the link. So processes are found by the namespace's
# inode (``/proc/PID/ns/net``), which still names it after the name is deleted, and
# looked for again for a short grace after the delete.
_GRACE_S = 1.0
_POLL_S = 0.05


def _inode(name: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return None


def _kill_in(inode: int) -> int:
    """SIGKILL every process in the network namespace ``inode``; how many were found."""
    found = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino != inode:
                continue
            os.kill(int(entry), signal.SIGKILL)
            found += 1
        except (OSError, ProcessLookupError):
            pass  # gone, or not ours to read
    return found


def _remove(name: str) -> None:
    """Kill what runs in the namespace (a rank the launcher left behind, a command
    still starting) and delete it; see [Note: a process that joins as the link is
    removed]."""
    inode = _inode(name)
    if inode is not None:
        _kill_in(inode)
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
    if inode is None:
        return
    deadline = time.monotonic() + _GRACE_S
    while time.monotonic() < deadline:
        _kill_in(inode)
        time.sleep(_POLL_S)


def remove_stale() -> list[str]:
    """Remove the namespaces of links whose creator died without removing them."""
    removed = []
    for name in _namespaces():
        m = _STALE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _remove(name)
            removed.append(name)
    return removed


def _qdisc_commands(
    name: str, spec: LinkSpec, *, verb: str = "add", netem: bool = True
) -> list[list[str]]:
    """tc's commands for ``spec`` on the namespace's lo (tc-netem(8)'s delay + rate);
    ``verb="replace"`` changes the shaping of a live link in place; ``netem=False``:
    the rate only (the delay line delays)."""
    assert spec.rate_bps is not None
    tc = ["ip", "netns", "exec", name, "tc", "qdisc", verb, "dev", "lo"]
    burst = max(_MIN_BURST, spec.rate_bps // 8 // 1000)  # a millisecond at the rate
    tbf = ["tbf", "rate", f"{spec.rate_bps}bit", "burst", str(burst), "limit", str(_QUEUE_BYTES)]
    if not spec.delay_ms or not netem:
        return [[*tc, "root", "handle", "1:", *tbf]]
    delay = ["netem", "delay", f"{spec.delay_ms:g}ms", "limit", "100000"]
    return [[*tc, "root", "handle", "1:", *delay], [*tc, "parent", "1:1", "handle", "10:", *tbf]]


class EmulatedLink:
    """A network namespace whose loopback is a link of ``spec``'s rate and delay.

    ::

        with EmulatedLink(LinkSpec.parse("2gbit,delay=1")) as link:
            print(link.self_check().line(link.spec))
            link.run(["torchrun", "--nproc-per-node", "2", "train.py"])

    Entering checks the tools and privileges and refuses with one line naming what is
    missing (`LinkUnavailableError`); it never falls back to an unshaped loopback.
    Leaving removes the namespace (see [Note: the namespace is removed on every exit
    path]). Only loopback addresses exist inside: nothing a command does there can
    reach another machine.
    """

    def __init__(self, spec: LinkSpec, *, name: str | None = None) -> None:
        self.spec = spec
        self.name = name or f"{PREFIX}{os.getpid()}-{next(_COUNTER)}"
        self.measurement: LinkMeasurement | None = None
        self.delay_by: str | None = None  # how spec's delay is made, once open
        self._made = False
        self._delay_line: subprocess.Popen[bytes] | None = None

    # -- lifecycle ------------------------------------------------------------

    def __enter__(self) -> EmulatedLink:
        for tool, package in _TOOLS.items():
            if shutil.which(tool) is None:
                raise LinkUnavailableError(
                    f"the emulated link needs `{tool}` on PATH (Debian/Ubuntu package "
                    f"{package}); it was not found, so no link was made"
                )
        remove_stale()
        _run(["ip", "netns", "add", self.name], "making the link's network namespace")
        self._made = True
        try:
            _run(
                ["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"],
                "bringing up the namespace's loopback",
            )
            if self.spec.shaped:
                self._shape()
                self._check_shaped()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Kill what runs inside and delete the namespace (idempotent)."""
        if self._made:
            self._made = False
            _remove(self.name)  # the delay line runs inside: killed with the rest
        if self._delay_line is not None:
            self._delay_line.kill()
            self._delay_line.wait()  # reaped, not left a zombie
            self._delay_line = None

    def _shape(self) -> None:
        """The rate by tbf; the delay by netem, or by the delay line where the kernel
        has no sch_netem and iptables is installed."""
        if not self.spec.delay_ms:
            for argv in _qdisc_commands(self.name, self.spec):
                _run(argv, "shaping the namespace's loopback")
            return
        try:
            for argv in _qdisc_commands(self.name, self.spec):
                _run(argv, "shaping the namespace's loopback")
            self.delay_by = "netem"
            return
        except LinkUnavailableError as e:
            if "no `netem`" not in str(e) or shutil.which("iptables") is None:
                raise
        # Nothing was added: the netem root failed first, so lo is still unshaped.
        for argv in _qdisc_commands(self.name, self.spec, netem=False):
            _run(argv, "shaping the namespace's loopback")
        self._start_delay_line()
        self.delay_by = DELAY_LINE

    def _start_delay_line(self) -> None:
        """Bind the queue first, then send the packets to it: a rule with no listener
        drops them (see [Note: the delay line] in _delay_line.py)."""
        assert self.spec.delay_ms is not None
        argv = [sys.executable, "-m", "cadence.link._delay_line", str(_QUEUE)]
        proc = subprocess.Popen(
            self.command([*argv, f"{self.spec.delay_ms:g}"]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._delay_line = proc
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], _READY_S)
        line = proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            proc.kill()
            err = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace")
            last = err.strip().splitlines()[-1:] or [f"no answer in {_READY_S:g} s"]
            raise LinkUnavailableError(
                f"the link's delay line (for delay= without sch_netem) did not start: {last[0]}"
            )
        _run(
            self.command(
                ["iptables", "-w", "-A", "OUTPUT", "-j", "NFQUEUE", "--queue-num", str(_QUEUE)]
            ),
            "sending the namespace's packets through the delay line",
        )

    def _check_shaped(self) -> None:
        """tc's own account of the qdisc, so a silently ignored command cannot pass."""
        out = _run(
            ["ip", "netns", "exec", self.name, "tc", "-j", "qdisc", "show", "dev", "lo"],
            "reading the loopback's shaping back",
        )
        kinds = {q.get("kind") for q in json.loads(out or "[]")}
        want = {"tbf"} | ({"netem"} if self.delay_by == "netem" else set())
        if self.delay_by == DELAY_LINE:
            rules = _run(self.command(["iptables", "-w", "-S", "OUTPUT"]), "reading the rules")
            line = self._delay_line
            if "NFQUEUE" not in rules or line is None or line.poll() is not None:
                raise LinkUnavailableError(
                    "the link's delay line is not in place (its rule or its process is "
                    "gone): the delay would be missing"
                )
        if not want <= kinds:
            raise LinkUnavailableError(
                f"the namespace's loopback shows qdiscs {sorted(k for k in kinds if k)} "
                f"after shaping, not {sorted(want)}: the kernel lacks sch_tbf/sch_netem "
                "(modprobe sch_tbf sch_netem)"
            )

    # -- use ------------------------------------------------------------------

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command that runs inside the link."""
        if not self._made:
            raise LinkUnavailableError(
                "the link is not open: use it inside `with EmulatedLink(...)`"
            )
        return ["ip", "netns", "exec", self.name, *argv]

    def active(self) -> ActiveLink:
        m = self.measurement
        return ActiveLink(
            self.spec,
            self.name,
            m.rate_bps if (m and self.spec.shaped) else None,
            m.rtt_ms if m else None,
        )

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a command inside: this process's, plus ``CADENCE_LINK``."""
        return {**os.environ, **(extra or {}), ENV_VAR: self.active().to_env()}

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> int:
        """Run ``argv`` inside the link, wait for it, return its exit status.

        Ctrl-C and SIGTERM reach the command (it shares this process group for
        Ctrl-C; SIGTERM is forwarded); the caller's ``with`` then removes the link.
        """
        proc = subprocess.Popen(self.command(argv), env=self.env(env))
        previous = signal.getsignal(signal.SIGTERM)

        def forward(signum: int, frame: object) -> None:
            proc.send_signal(signal.SIGTERM)
            raise KeyboardInterrupt

        in_main = _in_main_thread()
        if in_main:
            signal.signal(signal.SIGTERM, forward)
        try:
            return proc.wait()
        except BaseException:
            _stop(proc)
            raise
        finally:
            if in_main:
                signal.signal(signal.SIGTERM, previous)

    # -- faults, while commands run inside ---------------------------------------

    def reshape(self, spec: LinkSpec) -> None:
        """Give the link ``spec``'s rate and delay now, while commands run inside it.

        A wire that slows down mid-run (a congested switch, a degraded cable) or comes
        back: ``tc qdisc replace``, so the queue is never unshaped in between, then
        read back as on entry. An unshaped ``spec`` is refused: a link does not turn
        into the host's loopback.
        """
        if not spec.shaped:
            raise LinkUnavailableError(
                f"reshape({spec.text()!r}): give the link a rate; an emulated link is never "
                "unshaped (make a new one without shaping instead)"
            )
        self.command([])  # refuses a link that is not open
        if self.delay_by == DELAY_LINE and spec.delay_ms != self.spec.delay_ms:
            raise LinkUnavailableError(
                f"reshape({spec.text()!r}): this link's delay comes from the user-space "
                "delay line (no sch_netem), whose delay is fixed when the link is made; "
                f"keep delay={self.spec.delay_ms:g}, or make a new link"
            )
        for argv in _qdisc_commands(
            self.name, spec, verb="replace", netem=self.delay_by != DELAY_LINE
        ):
            _run(argv, "reshaping the namespace's loopback")
        self.spec = spec
        if self.delay_by != DELAY_LINE:
            self.delay_by = "netem" if spec.delay_ms else None
        self._check_shaped()

    def set_connected(self, connected: bool) -> None:
        """Cut the link (``False``: the namespace's loopback goes down, so no byte moves
        between ranks and a connect fails) or restore it (``True``).

        Open TCP connections survive a cut: their packets wait for retransmission, as
        across a link that drops for a few seconds. The shaping stays.
        """
        state = "up" if connected else "down"
        _run(self.command(["ip", "link", "set", "lo", state]), f"setting the loopback {state}")

    def self_check(self, seconds: float = 0.5) -> LinkMeasurement:
        """Send a known number of bytes through the link and time them.

        About ``seconds`` at the asked rate (1 MiB to 256 MiB; 64 MiB unshaped).
        """
        rate = self.spec.rate_bps
        nbytes = 64 << 20 if rate is None else int(min(max(rate / 8 * seconds, 1 << 20), 256 << 20))
        out = subprocess.run(
            self.command([sys.executable, "-m", "cadence.link._probe", str(nbytes)]),
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        if out.returncode != 0:
            raise LinkUnavailableError(
                f"the link's self-check failed: {out.stderr.strip().splitlines()[-1:]}"
            )
        d = json.loads(out.stdout)
        self.measurement = LinkMeasurement(
            int(d["bytes"]), d["seconds"], d["rate_bps"], d["rtt_ms"], self.delay_by
        )
        return self.measurement


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
