"""One traced pipeline step per side on a link: when each rank computed, and the picture.

The same chunk modules run under cadence's runtime and under torch's schedule, so one
instrument serves both: hooks on this rank's chunks record when each forward and each
backward through a chunk began and ended (``time.monotonic``, one clock for every
process of the machine). The gaps between the bars are where a rank waited: for a
message, on a delayed link, or for its peer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["trace_step", "write_pp_timeline"]

_COLORS = {"F": "#9ecae1", "B": "#3182bd"}
Span = tuple[str, int, float, float]  # kind, stage, start, end (monotonic seconds)


def trace_step(step: Callable[[], None], chunks: dict[int, Any]) -> list[Span]:
    """Run ``step`` once with hooks on ``chunks`` (stage -> module); its compute spans.

    Forward: the chunk's forward pre-hook and hook. Backward: hooks on autograd's nodes,
    not module backward hooks (those wrap the chunk's inputs and outputs in a function of
    their own, which torch's split backward refuses): a pre-hook on the node that made
    the chunk's output (the backward reaches the chunk) and a hook on the node of its
    first parametrised layer (the chunk's backward is done). Each backward pass through
    a chunk is a span: a split backward shows its input and weight parts as two.
    """
    import torch
    import torch.distributed as dist

    spans: list[Span] = []
    began: dict[tuple[str, int], float] = {}

    def mark_begin(kind: str, stage: int) -> None:
        began[(kind, stage)] = time.monotonic()

    def mark_end(kind: str, stage: int) -> None:
        start = began.pop((kind, stage), None)
        if start is not None:  # an end with no begin (a node run again) is not a span
            spans.append((kind, stage, start, time.monotonic()))

    def grad_fns(out: Any) -> list[Any]:
        tensors = out if isinstance(out, (tuple, list)) else (out,)
        return [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn]

    handles = []
    for stage, m in chunks.items():
        first = next(x for x in m.modules() if any(True for _ in x.parameters(recurse=False)))

        def f_begin(*_: Any, stage: int = stage) -> None:
            mark_begin("F", stage)

        def f_end(_m: Any, _i: Any, out: Any, stage: int = stage) -> None:
            mark_end("F", stage)
            for node in grad_fns(out):
                node.register_prehook(lambda *_: mark_begin("B", stage))

        def first_end(_m: Any, _i: Any, out: Any, stage: int = stage) -> None:
            for node in grad_fns(out):
                node.register_hook(lambda *_: mark_end("B", stage))

        handles += [
            m.register_forward_pre_hook(f_begin),
            m.register_forward_hook(f_end),
            first.register_forward_hook(first_end),
        ]
    try:
        dist.barrier()
        step()
    finally:
        for h in handles:
            h.remove()
    return spans


def write_pp_timeline(row: dict[str, Any], path: Path, title: str) -> Path | None:
    """Draw ``row["trace"]`` ({variant: {rank: spans}}) into ``path``; None without
    matplotlib. One lane per side and rank, from the earliest span of the row."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    trace: dict[str, dict[str, list[Span]]] = row["trace"]
    # Each side from its own first forward: the two were traced one after the other.
    first = {v: min((s[2] for r in ranks.values() for s in r), default=0.0)
             for v, ranks in trace.items()}  # fmt: skip
    lanes = [(f"{v} rank {r}", first[v], spans)
             for v in trace for r, spans in sorted(trace[v].items())]  # fmt: skip
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(lanes) + 1.6))
    for y, (_, t0, spans) in enumerate(reversed(lanes)):
        for kind, _stage, a, b in spans:
            ax.barh(y, 1e3 * (b - a), left=1e3 * (a - t0), color=_COLORS[kind], height=0.7)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([label for label, _, _ in reversed(lanes)])
    link = row.get("extra", {}).get("link", {})
    if "bound_ms" in link:
        ax.axvline(link["bound_ms"], ls="--", color="k", lw=1)
        ax.axvline(link["compute_ms"], ls=":", color="grey", lw=1)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, ["forward through a chunk", "backward through a chunk"],
              loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=8,
              frameon=False)  # fmt: skip
    ax.set_xlabel(
        "ms from the side's first forward; dashed: the schedule's bound on this link, "
        "dotted: with free messages"
    )
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
