"""cadence.ft (DataParallel under torchft) against plain cadence.DataParallel.

Run from the repository root (needs the ``ft`` extra, torchft 0.2.0):
    PYTHONPATH=src OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo python -m tests.foundation._ft_overhead \\
        [--model 12x512] [--steps 30] [--warmup 5] [--rounds 2]

The figures docs/multinode.md quotes come from it (a hand-run measurement, not a test:
the machine's noise decides the spread, so nothing here asserts on a time).

Two replicas of one rank each (processes, gloo on loopback, Adam, batch 32), run by
``tests/foundation/_ft_replica.py``: once as a plain world-2 DataParallel, once as two torchft
replica groups under an in-process lighthouse (a quorum per step, buckets through
``manager.allreduce``, the step gated on ``should_commit``). The rounds alternate
plain, ft, plain, ft, ... so the plain-vs-plain spread (A/A) shows the machine's noise.
A step is zero_grad + forward + backward + optimizer step, timed on each replica; the
figure is the median over the measured steps of the slower replica. Reported as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.foundation.test_ft import ROOT, _env, lighthouse


def _run(kind: str, args: argparse.Namespace, out: Path) -> tuple[float, float]:
    """Median step seconds (the slower replica's, per step) of one run, and the median
    seconds of ``opt.step()`` on replica 0 (for ft: the commit vote and the step)."""
    total = args.warmup + args.steps
    common = ["--model", args.model, "--batch", "32", "--out", str(out)]
    server = None
    if kind == "ft":
        server, address = lighthouse(min_replicas=2)
        (out / "stop").write_text(str(total))
        extra = ["--lighthouse", address, "--max-seconds", "300"]
    else:
        extra = ["--lighthouse", "-", "--plain", "2", "--steps", str(total)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.foundation._ft_replica",
                "--replica",
                str(r),
                *common,
                *extra,
            ],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=(out / f"replica_{r}.log").open("wb"),
        )
        for r in range(2)
    ]
    try:
        for p in procs:
            if p.wait(timeout=600) != 0:
                log = (out / f"replica_{procs.index(p)}.log").read_text(errors="replace")
                raise RuntimeError(f"{kind} replica exited {p.returncode}:\n{log[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        if server is not None:
            server.shutdown()
    rows = [
        {
            x["step"]: x
            for x in map(json.loads, (out / f"replica_{r}.jsonl").read_text().splitlines())
            if x["event"] == "step" and x["committed"]
        }
        for r in range(2)
    ]
    steps = sorted(rows[0].keys() & rows[1].keys())[args.warmup :]
    step = statistics.median(max(d[s]["dt"] for d in rows) for s in steps)
    return step, statistics.median(rows[0][s]["gate"] for s in steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="12x512")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")
    times: dict[str, list[float]] = {"plain": [], "ft": []}
    for _ in range(args.rounds):
        for kind in ("plain", "ft"):
            with tempfile.TemporaryDirectory() as tmp:
                step, gate = _run(kind, args, Path(tmp))
            times[kind].append(step)
            print(f"{kind:5s} median step {step * 1e3:7.2f} ms, opt.step() {gate * 1e3:6.2f} ms")
    plain, ft = times["plain"], times["ft"]
    print(
        f"min over runs: plain {min(plain) * 1e3:.1f} ms, ft {min(ft) * 1e3:.1f} ms, ratio {min(ft) / min(plain):.3f}"
    )
    print(f"A/A plain: max/min {max(plain) / min(plain):.3f} over {len(plain)} runs")
    print(f"B/B ft:    max/min {max(ft) / min(ft):.3f} over {len(ft)} runs")
    ratios = [f / p for f, p in zip(ft, plain)]
    print("ft / plain per round: " + ", ".join(f"{r:.3f}" for r in ratios))
    print(f"ft / plain, medians: {statistics.median(ft) / statistics.median(plain):.3f}")


if __name__ == "__main__":
    main()
