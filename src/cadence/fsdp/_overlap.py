"""``overlap_optimizer`` on a fully_shard module: each unit's shards stepped as its reduction completes.

[Note: fully_shard's overlapped optimizer]
The parts (see [Note: stepping an optimizer in parts] in ``cadence/_grad_timing/overlap_optimizer.py``)
are the units: part k is the sharded DTensor parameters of the root runtime's k-th
unit, the objects ``model.parameters()`` yields between steps and the optimizer holds.
Each unit's reduce-scatter (and HSDP all-reduce) is issued during backward and runs on
the backend; the wait-and-cleanup path waits the units oldest first and, with an
optimizer stepping early, steps unit k right after writing its sharded ``.grad`` and
before it waits unit k+1 ([Note: one wait-and-cleanup path] in ``_root_runtime.py``).
So unit k's update runs while k+1.. are still reducing, on the thread that waits (the
caller's), in the order every rank waits in: at the end of backward (automatic mode),
in ``finalize_backward()`` or the handle's ``wait()`` (manual mode), or in
``opt.step()`` when reductions were left pending. Not from the post-backward hooks
while backward still computes: the update would compete with backward for the same
cores or stream and gain nothing. Under HSDP a unit is stepped only after its
all-reduce over replicas was waited.

The optimizer does the math on the DTensor shards exactly as in the plain loop, one
unit's shards at a time; SGD, Adam and AdamW update each parameter from its own
gradient and state, so the bits are the plain loop's (tested against the same
fully_shard setup). Accumulation: backwards with ``set_requires_gradient_sync(False)``
reduce nothing, so nothing is stepped until the synced backward; reductions left in
flight by ``set_is_last_backward(False)`` add up in ``.grad`` and each unit is stepped
after its last one. A forward with grad after units were stepped and before
``opt.step()`` finished the step is refused: its backward would reduce into gradients
already applied (reducing every microbatch with automatic finalization does that).
Each stepped unit is marked in the event log (``fsdp.optimizer_step``, with the unit's
path under the root, "" for the root itself).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from cadence._grad_timing import autograd as _autograd
from cadence._grad_timing.overlap_optimizer import OverlapHandle, PartialStepper
from cadence.fsdp._errors import FullyShardError

if TYPE_CHECKING:
    from cadence.fsdp._root_runtime import RootRuntime
    from cadence.fsdp._unit import Unit

__all__ = ["OverlapHandle", "OverlapOptimizer", "OverlappedOptimizers"]


class OverlappedOptimizers:
    """The optimizers one root runtime steps unit by unit."""

    def __init__(self, runtime: RootRuntime) -> None:
        self._runtime = runtime
        self.steppers: list[PartialStepper] = []
        self._index = {id(u): k for k, u in enumerate(runtime.units)}
        self._parts_key: tuple[int, ...] = ()

    @property
    def steps_early(self) -> bool:
        return any(s.steps_early for s in self.steppers)

    def _pending(self) -> bool:
        rt = self._runtime
        handle = rt.handle is not None and not rt.handle.done
        return bool(rt.inflight or rt.retired or rt.backward_active or handle)

    def add(
        self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None, norm_type: float
    ) -> OverlapHandle:
        if _autograd.in_backward() or self._pending():
            raise FullyShardError(
                "overlap_optimizer() while a backward or its reductions are pending; call it "
                "between steps."
            )
        if self.owns(optimizer):
            raise FullyShardError("overlap_optimizer(): this optimizer is already overlapped")
        stepper = PartialStepper(
            optimizer,
            who="fully_shard",
            finish_pending=self.finish_pending,
            max_grad_norm=max_grad_norm,
            norm_type=norm_type,
            part="unit",
        )
        self._parts_key = ()  # the new stepper gets the parts at its first unit
        stepper.install()
        self.steppers.append(stepper)
        return OverlapHandle(self, stepper)

    def remove(self, stepper: PartialStepper) -> None:
        if stepper not in self.steppers:
            return
        if stepper.mid_step or self._pending():
            raise FullyShardError(
                "removing an overlapped optimizer in the middle of a step; call opt.step() first."
            )
        stepper.remove()
        self.steppers.remove(stepper)

    def owns(self, optimizer: Any) -> bool:
        return any(s.optimizer is optimizer for s in self.steppers)

    def _refresh_parts(self) -> None:
        """Each unit's sharded parameters, as the optimizer holds them now.

        ``load_state_dict(assign=True)`` registers new objects (see [Note: parameters
        replaced after sharding] in ``_materialize.py``), so the parts are re-read at the
        first unit of each step; they cannot change inside a step.
        """
        parts = [[info.sharded for info in u.params] for u in self._runtime.units]
        key = tuple(id(p) for part in parts for p in part) + tuple(len(p) for p in parts)
        if key != self._parts_key:
            for s in self.steppers:
                s.set_parts(parts)  # type: ignore[arg-type]  # every unit's params are sharded once built
            self._parts_key = key

    def on_unit_written(self, unit: Unit) -> None:
        """Step ``unit``'s shards: its reduced gradients are final for this step."""
        early = [s for s in self.steppers if s.steps_early]
        if not early:
            return
        if not any(s.mid_step for s in early):
            self._refresh_parts()
        log = self._runtime.event_log
        if log is not None:
            log.mark("fsdp.optimizer_step", unit=unit.path)
        k = self._index[id(unit)]
        for s in early:
            s.step_part(k)

    def check_forward(self) -> None:
        """A forward with grad between a unit's step and ``opt.step()`` is refused."""
        if any(s.mid_step for s in self.steppers):
            raise FullyShardError(
                "a forward after overlap_optimizer stepped this step's units, before "
                "opt.step() finished the step: its backward would reduce into gradients "
                "already applied. Fix: call opt.step() (and opt.zero_grad()) after the "
                "backward that reduces; accumulate microbatches with "
                "set_requires_gradient_sync(False), or leave their reductions in flight "
                "with set_is_last_backward(False) until the last one."
            )

    def finish_pending(self) -> None:
        """``opt.step()``: wait a pending handle, or finalize what backward left pending."""
        rt = self._runtime
        if not _autograd.in_backward():
            rt.check_backward_finished("optimizer.step()")
        if rt.handle is not None and not rt.handle.done:
            rt.handle.wait()
            return
        if rt.inflight or rt.retired:
            rt.finalize_backward(async_op=False)


class OverlapOptimizer:
    """The ``overlap_optimizer`` method of a fully_shard module (kept here, beside its machinery)."""

    _cadence_unit: Unit
    _cadence_runtime: RootRuntime

    def overlap_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
    ) -> OverlapHandle:
        """From now on, step each unit's shards as soon as its reduction completes.

        The loop stays ``loss.backward(); opt.step(); opt.zero_grad()``: the wait of
        the units' reductions (end of backward, ``finalize_backward()`` or its handle)
        steps unit k right after writing its sharded ``.grad``, while later units are
        still reducing (under HSDP, after its all-reduce), and ``opt.step()`` finishes
        whatever is left and returns. Parameters and optimizer state are bitwise those
        of the plain loop (SGD, Adam, AdamW); LR schedulers and step hooks see one step
        per ``opt.step()``. Call it on the root, between steps. See [Note: fully_shard's
        overlapped optimizer] (``fsdp/_overlap.py``) and [Note: stepping an optimizer in
        parts] (``cadence/_grad_timing/overlap_optimizer.py``).

        Refused: other optimizer classes (the reason is in the message), a closure, a
        forward with grad after units were stepped and before ``opt.step()``. Raised at
        ``opt.step()``: gradients of stepped units changed after their step
        (``clip_grad_norm_``, a GradScaler, ``zero_grad``) or a hyperparameter changed
        mid-step. Clip with ``max_grad_norm`` instead: the global norm needs every
        reduced gradient, so then nothing is stepped early and ``opt.step()`` clips (as
        ``clip_grad_norm_`` over the optimizer's parameters) and steps. ``remove()`` on
        the returned handle undoes it.
        """
        runtime: RootRuntime = self._cadence_runtime
        if self._cadence_unit is not runtime.root:
            raise FullyShardError(
                f"overlap_optimizer() on {type(self).__name__}, a unit nested under another "
                "fully_shard module: the root's runtime waits every unit. Fix: call it on the "
                "root (the module fully_shard was applied to last)."
            )
        overlap = runtime.overlap
        if not isinstance(overlap, OverlappedOptimizers):
            overlap = runtime.overlap = OverlappedOptimizers(runtime)
        return overlap.add(optimizer, max_grad_norm=max_grad_norm, norm_type=norm_type)
