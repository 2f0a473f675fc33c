"""`DataParallel.overlap_optimizer`: each bucket's parameters stepped as its reduction completes.

[Note: DataParallel's overlapped optimizer]
What overlaps with what. A bucket's all-reduce is launched during backward and runs
on the backend (gloo's threads, NCCL's stream). Finalization, at the end of backward
(automatic mode), in ``finalize_backward()`` or in the handle's ``wait()`` (manual
mode), or in ``opt.step()`` when the caller left it pending, waits the buckets in
launch order; right after bucket b's wait its gradients are written back and its
parameters stepped (`PartialStepper.step_part`), and only then is bucket b+1 waited.
So the optimizer's work on b runs while b+1.. are still on the wire: the update
overlaps the exposed tail of communication, where a plain loop would wait for every
bucket and then step everything. On NCCL, ``wait()`` only orders the stream, so the
host enqueues b's update behind b's all-reduce and moves on: the device runs it while
later all-reduces proceed.

Why not step earlier, from the gradient hooks while backward still computes: the
update would compete with backward for the same cores (CPU) or stream (GPU), so it
gains nothing, and it would run on autograd's thread and change parameters that a
not-yet-run node may still have saved (a version-counter error). Why not on the
thread that observes gloo's completion: torch optimizers are not thread-safe against
the caller's thread. Stepping where the caller already waits keeps every update on
the thread that owns the model, in launch order (the order every rank waits in).

``opt.step()`` then finishes whatever is left (a pending handle or manual window,
parameters the optimizer holds outside the wrapper, all of it with ``max_grad_norm``)
and returns. Backwards that do not sync (``no_sync()``, ``require_backward_grad_sync
= False``) reduce nothing, so nothing is stepped until a synced backward (or
``finalize_backward()`` with sync on) reduces the accumulated gradients. A bucket
stepped is marked in the event log (``dp.optimizer_step``, with its bucket index).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from cadence._grad_timing import autograd as _autograd
from cadence._grad_timing.overlap_optimizer import OverlapHandle, PartialStepper
from cadence.data_parallel._errors import DataParallelError

if TYPE_CHECKING:
    from cadence.comm import EventLog
    from cadence.data_parallel._reducer import Reducer

__all__ = ["OverlapHandle", "OverlapOptimizer", "OverlappedOptimizers"]


class OverlappedOptimizers:
    """The optimizers one DataParallel steps bucket by bucket."""

    def __init__(self, reducer: Reducer, event_log: EventLog) -> None:
        self._reducer = reducer
        self._log = event_log
        self.steppers: list[PartialStepper] = []

    def add(
        self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None, norm_type: float
    ) -> OverlapHandle:
        r = self._reducer
        if _autograd.in_backward() or r.pending:
            raise DataParallelError(
                "overlap_optimizer() while a backward or its reductions are pending; call it "
                "between steps."
            )
        if any(s.optimizer is optimizer for s in self.steppers):
            raise DataParallelError("overlap_optimizer(): this optimizer is already overlapped")
        stepper = PartialStepper(
            optimizer,
            who="DataParallel",
            finish_pending=self.finish_pending,
            max_grad_norm=max_grad_norm,
            norm_type=norm_type,
        )
        stepper.set_parts([b.params for b in r.buckets])
        stepper.install()
        self.steppers.append(stepper)
        r.on_bucket_reduced = self.on_bucket_reduced
        return OverlapHandle(self, stepper)

    def remove(self, stepper: PartialStepper) -> None:
        if stepper not in self.steppers:
            return
        if stepper.mid_step or self._reducer.pending:
            raise DataParallelError(
                "removing an overlapped optimizer in the middle of a step; call opt.step() first."
            )
        stepper.remove()
        self.steppers.remove(stepper)
        if not self.steppers:
            self._reducer.on_bucket_reduced = None

    def owns(self, optimizer: Any) -> bool:
        return any(s.optimizer is optimizer for s in self.steppers)

    def on_bucket_reduced(self, b: int) -> None:
        early = [s for s in self.steppers if s.steps_early]
        if early:
            self._log.mark("dp.optimizer_step", bucket=b)
        for s in early:
            s.step_part(b)

    def check_forward(self) -> None:
        """A forward with grad between a bucket's step and ``opt.step()`` is refused."""
        if any(s.mid_step for s in self.steppers):
            raise DataParallelError(
                "a forward after overlap_optimizer stepped this step's buckets, before "
                "opt.step() finished the step: the next backward would accumulate into "
                "gradients already applied. Fix: call opt.step() (and opt.zero_grad()) after "
                "each synced backward; accumulate with no_sync() / "
                "require_backward_grad_sync=False."
            )

    def finish_pending(self) -> None:
        """``opt.step()``: wait a pending handle, or finalize a pending window (stepping)."""
        r = self._reducer
        if r.failure is not None:
            r.check_can_start("optimizer.step()")  # raises, naming reset_iter_state()
        if r.handle is not None and not r.handle.done:
            r.handle.wait()
            return
        w = r.window
        if w is not None and w.sync:
            if not w.ended and not w.deferred and not _autograd.in_backward():
                r.check_can_start("optimizer.step()")  # the backward raised: says so
            r.finalize(blocking=True)


class OverlapOptimizer:
    """DataParallel's ``overlap_optimizer`` method (a base class, to keep the wrapper short)."""

    _overlap: OverlappedOptimizers

    def overlap_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
    ) -> OverlapHandle:
        """From now on, step each bucket's parameters as soon as its reduction completes.

        The loop stays ``loss.backward(); opt.step(); opt.zero_grad()``: finalization
        steps bucket b right after waiting it, while later buckets are still reducing,
        and ``opt.step()`` finishes whatever is left (a pending manual window or handle,
        parameters the optimizer holds outside this wrapper) and returns. Parameters and
        optimizer state are bitwise those of the plain loop (SGD, Adam, AdamW; foreach,
        fused or not); LR schedulers and step hooks see one step per ``opt.step()``.
        See [Note: DataParallel's overlapped optimizer] (``data_parallel/_overlap.py``)
        and [Note: stepping an optimizer in parts] (``cadence/_grad_timing/overlap_optimizer.py``).

        Refused: other optimizer classes (the reason is in the message), a closure.
        Raised at ``opt.step()``: gradients of stepped buckets changed after their step
        (``clip_grad_norm_``, a GradScaler, ``zero_grad`` between backward and step) or
        a hyperparameter changed mid-step. Clip with ``max_grad_norm`` instead: the
        global norm needs every reduced gradient, so then nothing is stepped early and
        ``opt.step()`` clips (as ``clip_grad_norm_`` over the optimizer's parameters in
        param-group order) and steps. ``remove()`` on the returned handle undoes it.
        """
        return self._overlap.add(optimizer, max_grad_norm=max_grad_norm, norm_type=norm_type)
