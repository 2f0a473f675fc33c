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
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cadence.errors import CadenceValueError
from cadence.link import EmulatedLink, LinkSpec, LinkUnavailableError, remove_stale
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


@needs_link
def test_delay_works_or_is_refused_naming_netem() -> None:
    refusal = netem_refusal()
    if refusal is None:  # a kernel with sch_netem: the delay is there, tc says so
        with EmulatedLink(LinkSpec.parse("100mbit,delay=2")) as link:
            out = subprocess.run(
                link.command(["tc", "qdisc", "show", "dev", "lo"]),
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            assert "netem" in out and "delay 2ms" in out, out
    else:
        assert "sch_netem" in refusal and "drop delay=" in refusal, refusal
    assert not any(n.startswith(f"cadence-link-{os.getpid()}-") for n in _namespaces())


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
