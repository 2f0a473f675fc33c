"""The emulated link (`cadence.link`): parsed, made, shaped, measured and removed.

Specification:

- ``RATE[,delay=MS]`` parses to bits per second and milliseconds; anything else is
  refused in one line that shows the accepted spelling.
- Inside the link only a loopback exists, shaped as asked: tc reads back a ``tbf`` of
  exactly that rate, so a link left unshaped fails. The self-check's transfer is
  counted, its rate reported, never asserted (tests never assert on time).
- The namespace is removed on every exit path: normal, an exception, Ctrl-C of
  ``cadence link``, a process still running inside; one whose creator was killed is
  removed by the next link made.
- A missing tool or kernel feature is refused in one line naming it.
- A live link is reshaped in place and cut and restored (`EmulatedLink.reshape`,
  `EmulatedLink.set_connected`), for faults in the middle of a run.

No torch: the link is plain Linux plumbing.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cadence.errors import CadenceValueError
from cadence.link import EmulatedLink, LinkSpec, LinkUnavailableError, _delay_line, remove_stale
from cadence.link._netns import DELAY_LINE
from tests.link._available import netem_refusal, unavailable

pytestmark = pytest.mark.torch_free

needs_link = pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}")


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _interruptible() -> None:
    # A suite started in the background (`./dev test &`, CI under nohup) inherits an
    # ignored SIGINT, and Python then leaves Ctrl-C ignored: the child would never see
    # the test's SIGINT. A terminal's Ctrl-C reaches a foreground command, as here.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cadence(*args: str, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cadence", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_interruptible,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("text", "rate", "delay"),
    [
        ("2gbit", 2_000_000_000, 0.0),
        ("1.5Gbit,delay=1", 1_500_000_000, 1.0),
        ("500mbit, delay=0.5ms", 500_000_000, 0.5),
        ("unshaped", None, 0.0),
    ],
)
def test_spellings(text: str, rate: int | None, delay: float) -> None:
    spec = LinkSpec.parse(text)
    assert (spec.rate_bps, spec.delay_ms) == (rate, delay)
    assert LinkSpec.parse(spec.text()) == spec
    assert LinkSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("fast", "link rate 'fast' not understood"),
        ("2gbit,jitter=1", "link option 'jitter=1' not understood"),
        ("500kbit", "below 1 Mbit/s"),
        ("unshaped,delay=1", "an unshaped link has no delay"),
        ("2gbit,delay=20000", "outside 0-10000 ms"),
    ],
)
def test_refusals_name_the_spelling(text: str, fragment: str) -> None:
    with pytest.raises(CadenceValueError) as info:
        LinkSpec.parse(text)
    assert fragment in str(info.value) and "RATE[,delay=MS]" in str(info.value)
    assert "\n" not in str(info.value)


@needs_link
def test_made_shaped_measured_removed() -> None:
    spec = LinkSpec.parse("200mbit")
    with EmulatedLink(spec) as link:
        assert link.name in _namespaces()
        qdiscs = json.loads(
            subprocess.run(
                link.command(["tc", "-j", "qdisc", "show", "dev", "lo"]),
                capture_output=True, text=True, check=True,
            ).stdout
        )  # fmt: skip
        tbf = [q for q in qdiscs if q["kind"] == "tbf"]
        assert len(tbf) == 1 and tbf[0]["options"]["rate"] == 200_000_000 // 8, qdiscs
        # Nothing but a loopback inside: no route off this machine.
        devices = Path("/proc/net/dev")  # read inside the link below
        out = subprocess.run(
            link.command(["cat", str(devices)]), capture_output=True, text=True, check=True
        ).stdout
        names = [line.split(":")[0].strip() for line in out.splitlines()[2:]]
        assert names == ["lo"], names
        # The self-check moves its bytes through the link and reports them; its rate is
        # a timing, shown to people, never asserted (tc's read-back above is the proof
        # that the link is shaped).
        m = link.self_check()
        assert m.bytes >= 1 << 20 and m.rate_bps > 0 and m.rtt_ms > 0
        assert "asked 200 Mbit/s; measured" in m.line(spec)
        name = link.name
    assert name not in _namespaces()


def _tbf_rates(link: EmulatedLink) -> list[int]:
    out = subprocess.run(
        link.command(["tc", "-j", "qdisc", "show", "dev", "lo"]),
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [q["options"]["rate"] for q in json.loads(out) if q["kind"] == "tbf"]


def _connects(link: EmulatedLink) -> bool:
    probe = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); " \
        "c = socket.create_connection(s.getsockname(), timeout=2)"  # fmt: skip
    return (
        subprocess.run(link.command([sys.executable, "-c", probe]), capture_output=True).returncode
        == 0
    )


@needs_link
def test_a_live_link_is_reshaped_and_cut_and_restored() -> None:
    """``reshape`` changes the rate in place (tc reads back the new one, never none),
    ``set_connected(False)`` cuts the loopback (a connect fails), ``True`` restores it
    with its shaping; an unshaped reshape is refused."""
    with EmulatedLink(LinkSpec.parse("1gbit")) as link:
        assert _tbf_rates(link) == [1_000_000_000 // 8]
        link.reshape(LinkSpec.parse("10mbit"))
        assert _tbf_rates(link) == [10_000_000 // 8] and link.spec.rate_bps == 10_000_000
        assert _connects(link)
        link.set_connected(False)
        assert not _connects(link), "a cut link still connects"
        link.set_connected(True)
        assert _connects(link) and _tbf_rates(link) == [10_000_000 // 8]
        with pytest.raises(LinkUnavailableError, match="never unshaped"):
            link.reshape(LinkSpec.parse("unshaped"))


@needs_link
def test_removed_on_error_and_kills_what_runs_inside() -> None:
    with pytest.raises(RuntimeError, match="boom"), EmulatedLink(LinkSpec.parse("100mbit")) as link:
        sleeper = subprocess.Popen(link.command(["sleep", "60"]))
        name = link.name
        raise RuntimeError("boom")
    assert name not in _namespaces()
    assert sleeper.wait(timeout=10) == -signal.SIGKILL


@needs_link
def test_stale_namespace_of_a_dead_creator_is_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"cadence-link-{dead.pid}-0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with EmulatedLink(LinkSpec.parse("100mbit")):
            assert stale not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True, check=False)
    assert remove_stale() == []


@needs_link
def test_ctrl_c_of_cadence_link_removes_the_namespace() -> None:
    proc = _cadence("link", "100mbit", "--no-check", "--", "sleep", "60")
    prefix = f"cadence-link-{proc.pid}-"
    deadline = time.monotonic() + 30
    while not any(n.startswith(prefix) for n in _namespaces()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    # The command itself runs inside (not a refused one that already exited).
    name = next(n for n in _namespaces() if n.startswith(prefix))
    while not subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert not any(n.startswith(prefix) for n in _namespaces())


@needs_link
def test_cadence_link_runs_the_command_inside_and_checks_first() -> None:
    proc = _cadence("link", "300mbit", "--", "cat", "/proc/net/dev")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "link self-check: asked 300 Mbit/s; measured" in err
    assert [line.split(":")[0].strip() for line in out.splitlines()[2:]] == ["lo"]
    # --no-check after RATE is this command's flag, not the command's first word.
    proc = _cadence("link", "300mbit", "--no-check", "--", "sh", "-c", "exit 7")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 7 and "self-check" not in err, err


def test_cadence_link_without_a_command_is_refused() -> None:
    proc = _cadence("link", "300mbit")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.strip().splitlines() == [
        "cadence link: error: give the command to run after --, e.g. "
        "'cadence link 2gbit -- torchrun --nproc-per-node 2 train.py'"
    ]


def test_a_missing_tool_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A PATH holding only `ip`: the link needs tc too and must say so, not run unshaped.
    ip = next(
        (Path(d) / "ip" for d in os.environ["PATH"].split(":") if (Path(d) / "ip").exists()), None
    )
    if ip is not None:
        (tmp_path / "ip").symlink_to(ip)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LinkUnavailableError) as info:
        EmulatedLink(LinkSpec.parse("1gbit")).__enter__()
    missing = "ip" if ip is None else "tc"
    assert f"needs `{missing}` on PATH" in str(info.value)


def _nfqueue_packets(link: EmulatedLink) -> int:
    """Packets the namespace's NFQUEUE rule has sent to the delay line so far."""
    out = subprocess.run(
        link.command(["iptables", "-w", "-L", "OUTPUT", "-v", "-x", "-n"]),
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rows = [line.split() for line in out.splitlines() if "NFQUEUE" in line]
    assert len(rows) == 1, out
    return int(rows[0][0])


@needs_link
def test_delay_works_or_is_refused_naming_netem() -> None:
    refusal = netem_refusal()
    held = None
    if refusal is None:
        with EmulatedLink(LinkSpec.parse("100mbit,delay=2")) as link:
            if link.delay_by == "netem":  # a kernel with sch_netem: tc says so
                out = subprocess.run(
                    link.command(["tc", "qdisc", "show", "dev", "lo"]),
                    capture_output=True, text=True, check=True,
                ).stdout  # fmt: skip
                assert "netem" in out and "delay 2ms" in out, out
            else:  # no sch_netem: every packet of the self-check went through the line
                assert link.delay_by == DELAY_LINE, link.delay_by
                before = _nfqueue_packets(link)
                line = link.self_check().line(link.spec)
                assert "delay line" in line and "sch_netem" in line, line
                assert _nfqueue_packets(link) > before + 100
                held = link._delay_line
                assert held is not None and held.poll() is None
        assert held is None or held.poll() is not None  # the line went with the link
    else:
        assert "sch_netem" in refusal and "drop delay=" in refusal, refusal
        assert "iptables" in refusal, refusal  # the other way to a delay is named
    assert not any(n.startswith(f"cadence-link-{os.getpid()}-") for n in _namespaces())


@needs_link
def test_a_link_whose_delay_line_died_passes_nothing_and_says_so() -> None:
    """Without its delay line the rule drops every packet: the ranks stall, never run
    undelayed, and the next look at the link names the cause."""
    refusal = netem_refusal()
    if refusal is not None:
        pytest.skip(f"no delay can be made here: {refusal}")
    with EmulatedLink(LinkSpec.parse("100mbit,delay=1")) as link:
        if link.delay_by != DELAY_LINE:
            pytest.skip(f"the delay is {link.delay_by}'s here, not the delay line's")
        assert link._delay_line is not None
        link._delay_line.kill()
        link._delay_line.wait()
        probe = "import socket; s = socket.create_server(('127.0.0.1', 0)); " + (
            "socket.create_connection(s.getsockname(), timeout=2)"
        )
        done = subprocess.run(link.command([sys.executable, "-c", probe]), capture_output=True)
        assert done.returncode != 0 and b"timed out" in done.stderr, done.stderr[-300:]
        with pytest.raises(LinkUnavailableError, match="delay line is not in place"):
            link.reshape(LinkSpec.parse("200mbit,delay=1"))


def test_delay_line_messages_parse() -> None:
    """The netfilter queue's wire format, without a kernel: a packet notification
    yields its id, an error ack raises with the errno's name."""
    notification = _delay_line._message(0, 0, _delay_line._attr(1, struct.pack("!IHB", 77, 8, 3)),
                                        seq=1, ack=False)  # fmt: skip
    assert _delay_line._packet_ids(notification + notification) == [77, 77]
    error = struct.pack("=IHHII", 36, 2, 0, 1, 0) + struct.pack("=i", -1) + b"\0" * 16
    with pytest.raises(OSError, match="Operation not permitted"):
        _delay_line._packet_ids(error)
    assert _delay_line._packet_ids(struct.pack("=IHHII", 16, 3, 0, 1, 0)) == []  # a DONE


def test_no_privilege_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An `ip` that answers as it does for a user without CAP_NET_ADMIN (the message is
    # iproute2's own), and a `tc`: the refusal names the capability and how to get it.
    fake = tmp_path / "ip"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1 $2" in "netns list") exit 0;; esac\n'
        "echo 'mount --make-shared /run/netns failed: Operation not permitted' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    (tmp_path / "tc").symlink_to(fake)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LinkUnavailableError) as info:
        EmulatedLink(LinkSpec.parse("1gbit")).__enter__()
    message = str(info.value)
    assert "`ip netns add cadence-link-" in message and "Operation not permitted" in message
    assert "needs CAP_NET_ADMIN and CAP_SYS_ADMIN" in message and "\n" not in message
