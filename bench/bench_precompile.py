"""Time to the first training step on N ranks: `cadence bench precompile` with its knobs.

Run: ``python bench/bench_precompile.py [--ranks 2] [--quick] [--shared-inductor-cache]
[--no-ship-kernels] [--json PATH]``.

The measurement is `cadence.bench.precompile` (modes ``jit``, ``precompile``,
``cache``; cold nodes, fresh processes; see its docstring). This script adds what
the ``cadence bench`` command keeps fixed: the number of ranks, one inductor cache
shared by the ranks of a run (one node) instead of one per rank, and artifacts
without their C++ kernels. It prints the table and writes the record only where
``--json`` says (never into ``bench/results/``, which feeds docs/benchmarks.md).
Numbers from a shared machine mean little; take them on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from cadence.bench import format_rows
from cadence.bench.precompile import run

__all__ = ["main"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 repetitions, a smaller model")
    parser.add_argument("--shared-inductor-cache", action="store_true")
    parser.add_argument("--no-ship-kernels", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the record here")
    args = parser.parse_args()
    record = run(
        quick=args.quick,
        world=args.ranks,
        shared_inductor_cache=args.shared_inductor_cache,
        ship_kernels=not args.no_ship_kernels,
    )
    print(format_rows(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
