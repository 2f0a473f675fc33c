"""`gradient_timing`: the `GradientTiming` verbs for torch's own DDP and FSDP2 modules.

[Note: driving torch's wrappers with the timing verbs]
Code written against `cadence.GradientTiming` (the pipeline runtime, a training
loop) can hold a torch ``DistributedDataParallel`` or a torch ``fully_shard``
module instead of a cadence wrapper: ``gradient_timing(module)`` returns an
adapter that speaks the same verbs. On a torch that has caller-side finalization
(2.15: FSDP2's ``set_manual_backward_finalization`` / ``finalize_backward``, DDP's
``require_manual_backward_finalization`` / ``finalize_backward``) the adapter
delegates to it. On torch 2.13 it keeps the meaning of every verb with what torch
offers, and refuses what torch cannot do rather than doing something else:

- ``set_requires_gradient_sync``: FSDP2 reads its flag when each group's backward
  runs, as the verb says. DDP reads ``require_backward_grad_sync`` at *forward*
  and arms its reducer there, so a pipeline (forwards of several microbatches,
  then their backwards, the flag on only for the last) cannot tell it which
  backward reduces. The adapter therefore runs every DDP forward with the flag
  off and arms the reducer itself when a backward *starts* with sync on
  (``reducer.prepare_for_backward``, from a hook on the forward's output, with
  that forward's outputs when ``find_unused_parameters`` needs them): exactly
  what DDP's forward would have done, taken at the time cadence's wrappers take
  it. With ``static_graph`` DDP's first iterations depend on the forward's
  decision, so there the flag is applied at forward, and a change between a
  forward and its backward is refused (set it before the forward).
- Manual finalization: torch 2.13 finalizes every syncing backward itself at its
  end, so the reduced gradients are always written when backward returns; the
  caller's ``finalize_backward`` then has nothing left to wait and returns a
  completed handle (``should_finalize_after_backward`` is False). The one thing
  torch 2.13 cannot do is the *deferred* reduction (reduce gradients accumulated
  with sync off, without another backward); ``finalize_backward`` refuses it,
  naming the fix (turn sync on before the last backward).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from cadence._timing import GradientTiming, refuse_inside_backward
from cadence.comm import ReductionHandle
from cadence.errors import CadenceRuntimeError, CadenceTypeError

__all__ = ["gradient_timing"]


class _TorchTiming:
    """Shared part of the two adapters; see [Note: driving torch's wrappers with the timing verbs]."""

    kind = "torch wrapper"

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._manual = False
        self._sync = True
        self._owed = False  # a backward accumulated with sync off, not reduced since
        self._armed_sync: bool | None = None  # the decision of a forward not yet backwarded
        module.register_forward_hook(self._after_forward)

    # -- bookkeeping hooks ------------------------------------------------------

    def _after_forward(self, _module: nn.Module, _args: Any, output: Any) -> None:
        self._watch(output, allowed=True)

    def _watch(self, output: Any, *, allowed: bool) -> None:
        """Call `_backward_started` when the backward of this forward's output starts.
        ``allowed``: False when the wrapper's own flag said no sync at this forward."""
        if not torch.is_grad_enabled():
            return
        self._armed_sync = self._sync
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.requires_grad:
                t.register_hook(lambda _grad: self._backward_started(tensors, allowed))
                break

    def _backward_started(self, outputs: list[torch.Tensor], allowed: bool) -> None:
        # A syncing backward reduces what earlier no-sync backwards accumulated too.
        self._owed = not (self._sync and allowed)
        self._armed_sync = None

    # -- the verbs --------------------------------------------------------------

    @property
    def require_manual_backward_finalization(self) -> bool:
        return self._manual

    @require_manual_backward_finalization.setter
    def require_manual_backward_finalization(self, enabled: bool) -> None:
        self.set_manual_backward_finalization(enabled)

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        refuse_inside_backward(
            "set_manual_backward_finalization()",
            "the end-of-backward callback reads the mode.",
            CadenceRuntimeError,
        )
        self._manual = bool(enabled)
        self._native_manual(self._manual)

    @property
    def should_finalize_after_backward(self) -> bool:
        return self._manual and self._sync and self._has_native()

    def set_requires_gradient_sync(self, enabled: bool, *, recurse: bool = True) -> None:
        refuse_inside_backward(
            "set_requires_gradient_sync()",
            "a backward's sync decision holds for the whole backward.",
            CadenceRuntimeError,
        )
        self._sync = bool(enabled)
        self._apply_sync(recurse)

    def finalize_backward(self, *, async_op: bool = False) -> ReductionHandle | None:
        if self._has_native():
            return self._native_finalize(async_op)
        if self._owed and self._sync:
            raise CadenceRuntimeError(
                f"finalize_backward() on a {self.kind} (torch {torch.__version__}): the "
                "gradients were accumulated with sync off and torch cannot reduce them "
                "without another backward (caller-side finalization is torch 2.15's). Fix: "
                "set_requires_gradient_sync(True) before the last backward instead."
            )
        # Every syncing backward was finalized by torch when it ended: nothing pending.
        return ReductionHandle.completed(self.kind) if async_op else None

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        def _check(*_: Any) -> None:
            if self._owed and self._sync:
                raise CadenceRuntimeError(
                    "optimizer.step() on gradients accumulated with sync off that were "
                    "never reduced. Fix: run the last backward with sync on."
                )

        return optimizer.register_step_pre_hook(_check)

    # torch's wrappers end (reduce, reshard) at the end of every autograd call, so
    # the input half of a split backward would finish a backward whose weight half
    # has not run. Checked before any group exists by the pipeline runtime.
    splits_backward = False

    def split_backward(self, part: str) -> AbstractContextManager[None]:
        raise CadenceRuntimeError(
            f"split_backward({part!r}) on a {self.kind}: torch's wrapper finishes its "
            "reduction at the end of every autograd call, so the input part of a split "
            "backward would reduce before the weight part ran. Fix: wrap the stage with "
            "cadence.DataParallel / cadence.fully_shard for zero-bubble schedules (ZB-H1, "
            "ZBV, DualPipeV), or use a schedule without I/W actions."
        )

    def reset_iter_state(self) -> None:
        self._owed = False
        self._armed_sync = None
        reset = getattr(self.module, "reset_iter_state", None)
        if reset is not None:
            reset()

    # -- per-wrapper parts ------------------------------------------------------

    def _has_native(self) -> bool:
        return hasattr(self.module, "finalize_backward")

    def _native_manual(self, enabled: bool) -> None:
        raise NotImplementedError

    def _native_finalize(self, async_op: bool) -> ReductionHandle | None:
        raise NotImplementedError

    def _apply_sync(self, recurse: bool) -> None:
        raise NotImplementedError


class _FSDP2Timing(_TorchTiming):
    kind = "torch FSDPModule"

    def _native_manual(self, enabled: bool) -> None:
        setter = getattr(self.module, "set_manual_backward_finalization", None)
        if setter is not None:
            setter(enabled)

    def _native_finalize(self, async_op: bool) -> ReductionHandle | None:
        result = self.module.finalize_backward(async_op=async_op)  # type: ignore[operator]
        if not async_op:
            return None
        return ReductionHandle([], on_complete=getattr(result, "wait", None), label=self.kind)

    def _apply_sync(self, recurse: bool) -> None:
        self.module.set_requires_gradient_sync(self._sync, recurse=recurse)  # type: ignore[operator]


class _DDPTiming(_TorchTiming):
    kind = "torch DistributedDataParallel"

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        # See [Note: driving torch's wrappers with the timing verbs]: the decision
        # is taken when a backward starts, except under static_graph.
        self._at_backward = not getattr(module, "static_graph", False)
        self._user_flag = True
        module.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, *_: Any) -> None:
        ddp: Any = self.module
        if not self._at_backward:
            ddp.require_backward_grad_sync = self._sync
            return
        # DDP's own flag (set by the script, or by ``no_sync()``) still counts: it
        # is read here, as DDP reads it, and put back after the forward.
        self._user_flag = bool(ddp.require_backward_grad_sync)
        ddp.require_backward_grad_sync = False

    def _after_forward(self, _module: nn.Module, _args: Any, output: Any) -> None:
        allowed = True
        if self._at_backward:
            allowed = self._user_flag
            self.module.require_backward_grad_sync = allowed
        self._watch(output, allowed=allowed)

    def _backward_started(self, outputs: list[torch.Tensor], allowed: bool) -> None:
        super()._backward_started(outputs, allowed)
        ddp: Any = self.module
        if not (self._at_backward and self._sync and allowed):
            return
        # What DDP's forward does with the flag on (DistributedDataParallel._post_forward).
        ddp.require_forward_param_sync = True
        ddp.reducer.prepare_for_backward(outputs if ddp.find_unused_parameters else [])

    def _native_manual(self, enabled: bool) -> None:
        if hasattr(self.module, "require_manual_backward_finalization"):
            self.module.require_manual_backward_finalization = enabled

    def _native_finalize(self, async_op: bool) -> ReductionHandle | None:
        self.module.finalize_backward()  # type: ignore[operator]  # blocking only in DDP
        return ReductionHandle.completed(self.kind) if async_op else None

    def _apply_sync(self, recurse: bool) -> None:
        armed = self._armed_sync
        if not self._at_backward and armed is not None and armed != self._sync:
            self._sync = armed
            raise CadenceRuntimeError(
                "set_requires_gradient_sync() between a forward and its backward on torch "
                "DistributedDataParallel with static_graph=True: DDP took the sync "
                f"decision at that forward (sync={armed}), so the backward would not follow "
                "the new flag. Fix: set it before the forward (or use cadence.DataParallel, "
                "which decides when the backward starts)."
            )
        if not self._at_backward:
            self.module.require_backward_grad_sync = self._sync


def gradient_timing(module: Any) -> GradientTiming | None:
    """The timing verbs of ``module``: itself for cadence's wrappers, an adapter for torch's.

    Returns None for a module no wrapper reduces (nothing to time). The adapter is
    created once per module and cached on it.
    """
    if isinstance(module, GradientTiming):
        return module
    cached = getattr(module, "_cadence_timing", None)
    if cached is not None:
        return cached
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    adapter: _TorchTiming
    if isinstance(module, FSDPModule):
        adapter = _FSDP2Timing(module)
    elif isinstance(module, DistributedDataParallel):
        adapter = _DDPTiming(module)
    elif isinstance(module, nn.Module) or module is None:
        return None
    else:
        raise CadenceTypeError(f"gradient_timing() takes an nn.Module, got {type(module).__name__}")
    object.__setattr__(module, "_cadence_timing", adapter)
    return adapter  # type: ignore[return-value]
