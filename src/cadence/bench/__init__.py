"""``cadence bench``: cadence against PyTorch's own implementations, side by side.

- ``dp``: DataParallel vs DDP (`cadence.bench.dp`);
- ``step``: whole training steps, cadence's overlaps (``overlap_optimizer``, sparse
  work during the dense reduction; nanoGPT's accumulation loop under DataParallel and
  fully_shard; a pp x dp pipeline whose stages step as their reductions complete) vs
  torch stepping after backward (`cadence.bench.step`);
- ``fsdp``: fully_shard vs FSDP2, step time and peak RSS growth (`cadence.bench.fsdp`);
- ``pp``: pipeline runtime vs torch pipelining, five schedules (`cadence.bench.pp`);
- ``collectives``: cadence's exchange collectives vs gloo's own
  (`cadence.bench.collectives`);
- ``pickle``: cadence.pickling vs cloudpickle (`cadence.bench.pickler`);
- ``precompile``: time to the first step on 2 ranks, ``torch.compile`` on every rank
  vs `cadence.precompile` (compile once, broadcast) vs its cache
  (`cadence.bench.precompile`);
- ``schedules``: building and proving every generator's schedule at 8..128 ranks,
  against torch's construction of the same schedule (`cadence.bench.schedules`);
- ``scale``: log-log figures with fitted slopes: schedule build and proof against
  p·m, setup bytes per rank against world size, fully_shard / FSDP2 and
  DataParallel / DDP init time and per-rank parameter bytes at fake worlds of 64 to
  8192 ranks (`cadence.bench.scale`).

Each comparison runs in one process tree, interleaves the implementations, and
reports median ratios with their spread, an A/A noise figure and the machine load.
`run_bench` writes the JSON record and its PNG chart into the folder it is given
(the CLI's ``--results``; by default the user's cache, ``~/.cache/cadence/bench``);
`write_docs` regenerates a page (``docs/benchmarks.md``) from the newest records and
keeps the records it cites beside it, in ``records/``.
"""

from __future__ import annotations

from cadence.bench._run import KINDS, format_rows, run_bench
from cadence.bench.report import write_docs

__all__ = ["KINDS", "format_rows", "run_bench", "write_docs"]
