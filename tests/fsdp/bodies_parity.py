"""Rank bodies for the fully_shard tests: each runs many checks in one launch.

Each body returns a dict of plain values; the pytest functions assert on single
entries, so every semantics bullet keeps its own test while a launch (about 2 s
of process start) is shared.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import cadence
from cadence.fsdp import fully_shard
from cadence.testing import max_abs_diff, run_subtests
from tests.fsdp.common import (
    TinyTransformer,
    apply_cadence,
    apply_torch,
    full_params,
    loss_fn,
    make_batches,
    make_blocks,
    make_mlp,
    reference_steps,
    train_steps,
)

__all__ = ["parity_body"]


# ---------------------------------------------------------------------------
# Parity: single process and torch fully_shard
# ---------------------------------------------------------------------------


def _called_by_torch_fsdp() -> bool:
    """Whether torch's FSDP2 issued the current ``torch.distributed`` call (not cadence,
    whose collectives may go through the same functions, nor ``full_tensor()``)."""
    frame = sys._getframe(2)
    while frame is not None:
        if "torch/distributed/fsdp/" in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back  # type: ignore[assignment]  # None ends the walk
    return False


class _Counter:
    """Counts torch.distributed collectives called by torch's fully_shard (looked up late).

    ``fsdp2_only``: count only the calls FSDP2 itself issues (see `_called_by_torch_fsdp`),
    and only the outermost (one of these functions may call another); otherwise every
    call, which is what tests running FSDP2 alone count.
    """

    _KINDS = {
        "all_gather_single": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
    }

    def __init__(self, *, fsdp2_only: bool = False) -> None:
        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        self._orig: dict[str, Callable[..., Any]] = {}
        self._fsdp2_only = fsdp2_only
        self._depth = 0

    def _counts_now(self) -> bool:
        return not self._fsdp2_only or (self._depth == 0 and _called_by_torch_fsdp())

    def __enter__(self) -> _Counter:
        for name, kind in self._KINDS.items():
            if hasattr(dist, name):
                self._orig[name] = orig = getattr(dist, name)

                def wrapped(*a: Any, _o: Any = orig, _k: str = kind, **k: Any) -> Any:
                    if self._counts_now():
                        self.counts[_k] += 1
                    self._depth += 1
                    try:
                        return _o(*a, **k)
                    finally:
                        self._depth -= 1

                setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, orig in self._orig.items():
            setattr(dist, name, orig)

    def take(self) -> tuple[int, int]:
        out = (self.counts["all_gather"], self.counts["reduce_scatter"])
        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        return out


def _parity(kind: str, make: Callable[[], nn.Module], rank: int, world: int) -> dict[str, float]:
    batches = make_batches(kind, 3, 12)
    base = make()
    ref = reference_steps(base, batches)
    ours = copy.deepcopy(base)
    theirs = copy.deepcopy(base)
    units = ours.units() if hasattr(ours, "units") else [ours[0], ours[2], ours[4]]
    apply_cadence(ours, units)
    t_units = theirs.units() if hasattr(theirs, "units") else [theirs[0], theirs[2], theirs[4]]
    apply_torch(theirs, t_units)
    train_steps(ours, batches, rank, world)
    train_steps(theirs, batches, rank, world)
    got, fsdp2 = full_params(ours), full_params(theirs)
    return {
        f"{kind}_vs_single": max_abs_diff(got, ref),
        f"{kind}_vs_fsdp2": max_abs_diff(got, fsdp2),
        f"{kind}_fsdp2_vs_single": max_abs_diff(fsdp2, ref),
    }


def _counts_by_mode(rank: int, world: int) -> dict[str, Any]:
    """Per-microbatch (all-gather, reduce-scatter) counts for each accumulation mode."""
    out: dict[str, Any] = {}
    batches = make_batches("blocks", 1, 8)
    ref = reference_steps(make_blocks(), batches)
    modes: dict[str, Callable[[Any, int, bool], None]] = {
        # (a) reduce every microbatch (sharded accumulation)
        "every": lambda m, i, last: None,
        # (b) no sync, unsharded grads kept, reshard after backward
        "nosync": lambda m, i, last: m.set_requires_gradient_sync(last),
        # (c) no sync and no reshard after backward (ZeRO-1-like)
        "nosync_noreshard": lambda m, i, last: (
            m.set_requires_gradient_sync(last),
            m.set_reshard_after_backward(last),
        ),
    }

    def run(mode: str, impl: str) -> tuple[list[tuple[int, int]], float]:
        before = modes[mode]
        base = make_blocks()
        log = cadence.EventLog()
        if impl == "cadence":
            model = apply_cadence(base, base.units(), unit_raf=True, event_log=log)
        else:
            model = apply_torch(base, base.units(), unit_raf=True)
        per_micro: list[tuple[int, int]] = []
        with _Counter() as counter:
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            local = batches[0].chunk(world)[rank]
            for i, mb in enumerate(local.chunk(2)):
                last = i == 1
                before(model, i, last)
                if impl == "fsdp2":
                    model.set_is_last_backward(last)
                log.clear()
                (loss_fn(model, mb) / 2).backward()
                if impl == "cadence":
                    per_micro.append((log.count("all_gather"), log.count("reduce_scatter")))
                else:
                    per_micro.append(counter.take())
            opt.step()
        return per_micro, max_abs_diff(full_params(model), ref)

    runs = run_subtests({"mode": list(modes), "impl": ["cadence", "fsdp2"]}, run)
    for mode in modes:
        for impl in ("cadence", "fsdp2"):
            out[f"{mode}_{impl}"], out[f"{mode}_{impl}_parity"] = runs[
                f"mode={mode!r},impl={impl!r}"
            ]
    return out


def parity_body(ckpt_dir: str | None = None) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    out.update(_parity("mlp", make_mlp, rank, world))
    out.update(_parity("tokens", TinyTransformer, rank, world))
    if world == 2:
        out.update(_counts_by_mode(rank, world))
    # Sharding geometry: local shapes follow torch.chunk (padding at the tail).
    m = make_mlp()
    fully_shard(m)
    w = m[0].weight
    out["placements"] = str(w.placements)
    out["is_dtensor"] = isinstance(w, DTensor)
    out["local_rows_l0"] = w.to_local().shape[0]
    out["local_rows_l2"] = m[2].weight.to_local().shape[0]
    return out
