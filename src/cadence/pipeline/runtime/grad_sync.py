"""Deferred gradient reduction for stages wrapped in a data-parallel wrapper.

[Note: the runtime drives wrappers through their public verbs only]
The runtime never looks inside a wrapper and never checks which one it holds. It
calls only the public timing verbs of `cadence._grad_timing.timing.GradientTiming`, which
`cadence.DataParallel` and `cadence.fully_shard` both implement (and
`cadence.gradient_timing` adapts torch's DDP and FSDP2 modules to), so one runtime
drives every wrapper and a wrapper's internals can change without touching the
pipeline. (torch pipelining instead toggles DDP's private flags and calls its
reducer by hand, under a comment that calls it a hack; it breaks whenever DDP
changes.) The verbs, in the order a step uses them:

- ``set_manual_backward_finalization(True)`` once per step, so a backward launches
  reductions but leaves finishing them to us;
- ``set_requires_gradient_sync(flag)`` before every backward of the stage: True
  only for the stage's *last* gradient-producing backward (B or W) of the step,
  so earlier microbatches accumulate locally and the reduction runs once;
- ``split_backward("input")`` / ``split_backward("weight")`` around I and W (see
  [Note: split backwards drive the same reductions]);
- ``finalize_backward(async_op=True)`` at REDUCE_GRAD: issue, keep the handle;
- ``handle.wait()`` at WAIT_REDUCE_GRAD, just before the result is needed (or at
  the end of the step when the schedule has no wait action);
- ``unshard(async_op=True)`` / ``reshard()`` of every unit of the stage (nested
  ones included) at UNSHARD / RESHARD, on the units that are a
  `cadence._grad_timing.timing.ShardedTiming` (fully_shard's are; DataParallel holds no
  shards); a stage with these actions has its ``set_reshard_after_forward/backward``
  turned off at construction, so the schedule alone decides when it is gathered.

Whether a stage can run a split backward at all is `cadence._grad_timing.timing.splits_backward`
(False only for the adapters of torch's own wrappers).

Scaling is not done here: the loss is scaled once before backward (see
``microbatch.py``), so reduced gradients need no further division by ``m``.

[Note: split backwards drive the same reductions]
Zero-bubble schedules (ZB-H1, ZBV, DualPipeV) run a microbatch's backward as I
(input gradients) and, later, W (weight gradients). The runtime runs each inside
the wrapper's ``split_backward("input")`` / ``split_backward("weight")`` (see
[Note: split backward parts] in ``cadence/_grad_timing/timing.py``), and W accumulates
through the parameters' own AccumulateGrad nodes (``split_backward.py``), so W
launches the same per-parameter reductions a full backward would: DataParallel
buckets, fully_shard reduce-scatters per unit. The sync flag is True only for the
stage's last W, which is therefore the one that reduces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from cadence._grad_timing.timing import GradientTiming, ShardedTiming, splits_backward
from cadence._grad_timing.torch_timing import gradient_timing
from cadence.comm import ReductionHandle
from cadence.pipeline.runtime.errors import PipelineStateError
from cadence.pipeline.schedule.ir import Action, ActionKind

__all__ = ["StageGradSync", "last_backwards", "split_refusal"]


class StageGradSync:
    """The timing verbs for one local stage's module; a no-op for plain modules."""

    def __init__(self, module: Any) -> None:
        # cadence's wrappers, or an adapter for torch's DDP / FSDP2 (None: plain module).
        self.timing: GradientTiming | None = gradient_timing(module)
        self._module = module
        self._handle: ReductionHandle | None = None
        self._unshards: list[Any] = []  # in-flight UNSHARD handles, one per unit
        self._sync = True
        self.reduced = False
        # "reduce" / "wait" in the order they ran, over the runtime's lifetime (tests read it).
        self.history: list[str] = []

    def begin_step(self, sync: bool) -> None:
        self._sync = sync
        self.reduced = False
        if self.timing is not None:
            self.timing.set_manual_backward_finalization(True)

    def before_backward(self, is_last: bool) -> None:
        if self.timing is not None:
            self.timing.set_requires_gradient_sync(self._sync and is_last)

    def split_refusal(self) -> str | None:
        """Why this stage cannot run a split (I/W) backward, or None if it can."""
        if self.timing is None or splits_backward(self.timing):
            return None
        return (
            f"{type(self._module).__name__} is a torch wrapper, which finishes its reduction "
            "at the end of every autograd call, so it cannot run this schedule's split "
            "(I/W) backward; wrap the stage with cadence.DataParallel or "
            "cadence.fully_shard, or use a schedule without I/W actions"
        )

    def split(self, part: str) -> AbstractContextManager[None]:
        """The context one part (``"input"`` / ``"weight"``) of a split backward runs in."""
        if self.timing is None:
            return nullcontext()
        return self.timing.split_backward(part)

    def reduce(self) -> None:
        """REDUCE_GRAD: issue the stage's reduction and keep its handle."""
        if self.timing is None or not self._sync:
            return
        if self._handle is not None:
            raise PipelineStateError(
                "REDUCE_GRAD issued twice for one stage in a step without a wait; "
                "the schedule must have one REDUCE_GRAD per stage per step"
            )
        self._handle = self.timing.finalize_backward(async_op=True) or ReductionHandle.completed()
        self.reduced = True
        self.history.append("reduce")

    def wait(self) -> None:
        """WAIT_REDUCE_GRAD: the reduced gradients are visible after this returns."""
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
            self.history.append("wait")

    def end_step(self) -> None:
        """Close the step: wait a reduction the schedule left open, or finalize one
        the schedule never issued (a schedule lowered without REDUCE_GRAD)."""
        if self.timing is None:
            return
        if self._sync and not self.reduced:
            self.reduce()
        self.wait()

    def take_placement(self) -> None:
        """The schedule has UNSHARD/RESHARD for this stage: it, not the wrapper's
        reshard-after-forward/backward flags, decides when parameters are gathered."""
        for m in self._module.modules():
            if isinstance(m, ShardedTiming):
                m.set_reshard_after_forward(False, recurse=False)
                m.set_reshard_after_backward(False, recurse=False)

    def unshard(self) -> None:
        """UNSHARD: issue the all-gather of every unit of the stage (nested ones too,
        e.g. one per block under the stage's root), async; each first use waits."""
        self._wait_unshards()  # a previous step's, never resharded: done by now
        for m in self._module.modules():
            if isinstance(m, ShardedTiming):
                self._unshards.append(m.unshard(async_op=True))

    def _wait_unshards(self) -> None:
        for handle in self._unshards:
            if handle is not None:
                handle.wait()
        self._unshards = []

    def reshard(self) -> None:
        """RESHARD: free every unsharded parameter of the stage (nested units included)."""
        self._wait_unshards()
        for m in self._module.modules():
            if isinstance(m, ShardedTiming):
                m.reshard()


def last_backwards(actions: Sequence[Action]) -> dict[int, int]:
    """Per local stage, the index of its last gradient-producing action (B or W)."""
    last: dict[int, int] = {}
    for i, a in enumerate(actions):
        for c in a.compute_parts():
            if c.kind in (ActionKind.B, ActionKind.W):
                last[c.stage] = i
    return last


def split_refusal(actions: Sequence[Action], syncs: Mapping[int, StageGradSync]) -> str | None:
    """Why a local stage with I/W actions cannot split its backward, or None if all can."""
    split = {
        c.stage
        for a in actions
        for c in a.compute_parts()
        if c.kind in (ActionKind.I, ActionKind.W)
    }
    for s in sorted(split & set(syncs)):
        why = syncs[s].split_refusal()
        if why is not None:
            return f"stage {s}: {why}"
    return None
