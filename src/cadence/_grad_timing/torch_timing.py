"""`gradient_timing`: the `GradientTiming` verbs for torch's own DDP and FSDP2 modules.

[Note: driving torch's wrappers with the timing verbs]
Code written against `cadence.GradientTiming` (the pipeline runtime, a training
loop) can hold a torch ``DistributedDataParallel`` or a torch ``fully_shard``
module instead of a cadence wrapper: ``gradient_timing(module)`` returns an
adapter that speaks the same verbs, with the meanings of [Note: one set of timing
verbs] in ``cadence/_grad_timing/timing.py``. What torch provides is detected by capability,
not by version: DDP's ``require_manual_backward_finalization`` and
``finalize_backward()``, FSDP2's ``set_manual_backward_finalization`` and
``finalize_backward(async_op=...)`` (both in torch 2.15, neither in 2.13). The
adapter uses torch's verbs where they exist, keeps each verb's meaning with what
torch offers where they do not, and refuses what torch cannot do, naming the fix,
rather than doing something else.

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
- Manual finalization, with torch's verbs (torch 2.15): manual mode is torch's
  own, so a syncing backward launches its reductions (DDP's bucket all-reduces,
  FSDP2's reduce-scatters) and leaves them in flight; ``finalize_backward()``
  waits them and writes ``.grad`` through torch's ``finalize_backward``. With
  ``async_op=True`` the returned `ReductionHandle` stays pending (``done`` is
  False, forwards and ``optimizer.step()`` are refused) until ``wait()``, which
  is where torch's waiting happens: FSDP2's own ``finalize_backward(async_op=
  True)`` handle is waited there; DDP has no asynchronous finalize, so its
  blocking ``finalize_backward()`` is what ``wait()`` runs (the all-reduces were
  launched by backward and are in flight meanwhile; ``.grad`` still holds the
  local gradients until then). torch offers no way to poll either, so
  ``is_completed()`` is False until ``wait()``. torch holds the mode from a
  manual backward until its finalize, so changing it in between is refused
  (finalize first); a configuration torch refuses manual mode for (e.g. DDP
  with every parameter in ``delay_all_reduce_named_params``) raises torch's error.
- Deferred reduction (gradients accumulated with sync off, reduced with sync on
  again without another backward): FSDP2 with torch's verbs performs it in
  ``finalize_backward`` (torch's finalize runs the post-backward that the no-sync
  backwards left pending); in automatic mode the adapter turns torch's manual
  mode on for that one call, as torch requires. DDP reduces only from a
  backward's hooks, on every torch, and torch 2.13's FSDP2 has no finalize, so
  there ``finalize_backward`` refuses it, naming the fix (turn sync on before the
  last backward), and ``optimizer.step()`` on those gradients is refused too.
- Without torch's verbs (torch 2.13), or in automatic mode: torch finalizes every
  syncing backward itself at its end, so the reduced gradients are written when
  backward returns; ``finalize_backward`` then has nothing left to wait and
  returns a completed handle (``should_finalize_after_backward`` is False).
- Nothing pending (no syncing backward since the last finalize, nothing
  deferred): ``finalize_backward`` issues nothing and returns None or a completed
  handle, as cadence's wrappers do; torch's verbs, which raise there, are not
  called. (FSDP2 in manual mode after a no-sync backward is the exception: torch
  keeps that backward's iteration open, so its finalize is called to close it;
  with sync still off it reduces nothing.) A second ``finalize_backward`` while a
  handle is unwaited raises.
- Inside backward (the optimizer-in-backward pattern): allowed where torch allows
  it, i.e. DDP in torch's manual mode once every bucket is ready (torch checks;
  too early is refused with torch's reason). FSDP2 finalizes only after backward
  completes, and torch without manual mode (always so on 2.13) only at the end
  of backward, so a finalize inside a syncing backward there is refused with the
  fix (after backward returns, or cadence's wrappers), never answered with
  gradients that are not reduced yet.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from cadence._grad_timing import autograd as _autograd
from cadence._grad_timing.timing import GradientTiming, refuse_inside_backward
from cadence.comm import CommWork, ReductionHandle
from cadence.errors import CadenceRuntimeError, CadenceTypeError

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["gradient_timing"]


class _TorchFinish(CommWork):
    """torch's wait-and-write-back, run by the `ReductionHandle` that returns it.

    torch's handles (and DDP's blocking finalize) cannot be polled, so unlike a
    collective this is complete only once ``wait()`` has run it.
    """

    __slots__ = ()

    def __init__(self, finish: Callable[[], None]) -> None:
        super().__init__(None, after=finish)

    def is_completed(self) -> bool:
        return self._done


class _TorchTiming:
    """Shared part of the two adapters; see [Note: driving torch's wrappers with the timing verbs]."""

    kind = "torch wrapper"
    cadence_twin = "cadence's wrappers"

    def __init__(self, module: nn.Module, *, native: bool) -> None:
        self.module = module
        # torch has caller-side finalization for this wrapper (detected, not versioned).
        self.native_finalization = native
        self._manual = False
        self._sync = True
        self._owed = False  # a backward accumulated with sync off, not reduced since
        self._pending = False  # a manual syncing backward's reductions, not finalized
        self._open = False  # torch's manual iteration open: its finalize must end it
        self._armed_sync: bool | None = None  # the decision of a forward not yet backwarded
        self._sync_task: int | None = None  # graph task of the last syncing backward
        self._handle: ReductionHandle | None = None
        # prepend: refuse before torch's own forward hooks run (or raise their errors).
        module.register_forward_pre_hook(self._guard_forward, prepend=True)
        module.register_forward_hook(self._after_forward)

    # -- bookkeeping hooks ------------------------------------------------------

    def _guard_forward(self, *_: Any) -> None:
        self._check_can_start("forward")

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
        syncs = self._sync and allowed
        # A syncing backward reduces what earlier no-sync backwards accumulated too.
        self._owed = not syncs
        self._armed_sync = None
        if syncs:
            self._sync_task = _autograd.current_graph_task_id()
        if self._manual_in_torch() and (syncs or self._nosync_opens):
            # torch leaves the reductions in flight, and its iteration open, for
            # the caller's finalize_backward.
            self._open = True
            self._pending = self._pending or syncs

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
        enabled = bool(enabled)
        if self._open and enabled != self._manual:
            raise CadenceRuntimeError(
                f"set_manual_backward_finalization({enabled}) on a {self.kind} after a "
                "backward in manual mode that was not finalized: torch holds the mode "
                "until then. Fix: call finalize_backward() first."
            )
        if self.native_finalization:
            self._set_torch_manual(enabled)
        self._manual = enabled

    @property
    def should_finalize_after_backward(self) -> bool:
        return self._manual_in_torch() and self._sync

    def set_requires_gradient_sync(self, enabled: bool, *, recurse: bool = True) -> None:
        refuse_inside_backward(
            "set_requires_gradient_sync()",
            "a backward's sync decision holds for the whole backward.",
            CadenceRuntimeError,
        )
        self._sync = bool(enabled)
        self._apply_sync(recurse)

    def finalize_backward(self, *, async_op: bool = False) -> ReductionHandle | None:
        if self._handle is not None and not self._handle.done:
            raise CadenceRuntimeError(
                f"finalize_backward() on a {self.kind} called again before the previous "
                "handle was waited: wait on the previous handle (handle.wait()) first."
            )
        if _autograd.in_backward():
            return self._finalize_inside_backward(async_op)
        deferred = self._owed and self._sync
        if deferred and not self._defers():
            raise CadenceRuntimeError(
                f"finalize_backward() on a {self.kind} (torch {torch.__version__}): the "
                "gradients were accumulated with sync off and torch cannot reduce them "
                f"without another backward{self._why_no_deferral()}. Fix: "
                "set_requires_gradient_sync(True) before the last backward instead."
            )
        if not (self._open or deferred):
            # Nothing in flight: torch finalized every syncing backward at its end.
            return ReductionHandle.completed(self.kind) if async_op else None
        return self._finalize_in_torch(async_op)

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        def _check(*_: Any) -> None:
            self._check_can_start("optimizer.step()")
            if self._owed and self._sync:
                fix = (
                    "call finalize_backward() first (it reduces them)"
                    if self._defers()
                    else "run the last backward with sync on"
                )
                raise CadenceRuntimeError(
                    "optimizer.step() on gradients accumulated with sync off that were "
                    f"never reduced. Fix: {fix}."
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

    def overlap_optimizer(self, optimizer: torch.optim.Optimizer, **_: Any) -> Any:
        raise CadenceRuntimeError(
            f"overlap_optimizer() on a {self.kind}: torch's wrapper waits its reductions "
            "inside its own backward hooks, so there is no point between one bucket's (or "
            "unit's) wait and the next where a part could be stepped. Fix: call opt.step() "
            "after backward, or wrap the module with cadence.DataParallel / "
            "cadence.fully_shard, whose overlap_optimizer steps each part as it completes."
        )

    def reset_iter_state(self) -> None:
        self._owed = False
        self._pending = False
        self._open = False
        self._armed_sync = None
        self._sync_task = None
        self._handle = None
        reset = getattr(self.module, "reset_iter_state", None)
        if reset is not None:
            reset()

    # -- shared machinery -------------------------------------------------------

    def _check_can_start(self, what: str) -> None:
        """Refuse ``what`` while reductions the caller owns are not finished."""
        if self._handle is not None and not self._handle.done:
            raise CadenceRuntimeError(
                f"cannot run {what} on a {self.kind}: finalize_backward(async_op=True) "
                "returned a handle that has not been waited, so .grad is not the reduced "
                "gradient yet. Fix: call handle.wait() first."
            )
        if self._pending and self._pending_blocks(what):
            raise CadenceRuntimeError(
                f"cannot run {what} on a {self.kind}: a synced backward's reductions are "
                "still in flight (manual finalization). Fix: call finalize_backward() first."
            )

    def _pending_blocks(self, what: str) -> bool:
        return what == "optimizer.step()" or not _autograd.in_backward()

    def _manual_in_torch(self) -> bool:
        """Whether torch itself leaves syncing backwards for the caller to finalize."""
        return self._manual and self.native_finalization

    def _finalize_inside_backward(self, async_op: bool) -> ReductionHandle | None:
        running = self._sync_task == _autograd.current_graph_task_id()
        if not (running or self._open):
            return ReductionHandle.completed(self.kind) if async_op else None
        if not self._manual_in_torch():
            raise CadenceRuntimeError(
                f"finalize_backward() inside backward on a {self.kind} (torch "
                f"{torch.__version__}): torch finalizes this backward itself when it "
                "ends (its manual finalization is off or absent), so the gradients are "
                "not reduced yet. Fix: call it after backward returns, or use "
                f"{self.cadence_twin}, which allows it once every reduction has launched."
            )
        try:
            # Inside backward torch checks every reduction has launched: run it now,
            # so that a call made too early raises here, not at a later wait().
            self._finalize_in_torch(False)
        except RuntimeError as exc:
            if isinstance(exc, CadenceRuntimeError):
                raise
            raise CadenceRuntimeError(
                f"finalize_backward() inside backward on a {self.kind}: torch refused it "
                f"({exc}). Fix: call it after backward returns{self._inside_fix()}."
            ) from exc
        return ReductionHandle.completed(self.kind) if async_op else None

    def _finished(self) -> None:
        """torch wrote the reduced gradients: nothing is in flight or owed any more."""
        self._pending = False
        self._open = False
        if self._sync:
            self._owed = False

    def _handle_for(self, finish: Callable[[], None]) -> ReductionHandle:
        self._handle = ReductionHandle(
            [_TorchFinish(finish)], on_complete=self._finished, label=self.kind
        )
        return self._handle

    # -- per-wrapper parts ------------------------------------------------------

    # Whether a no-sync backward in torch's manual mode opens an iteration too.
    _nosync_opens = False

    def _defers(self) -> bool:
        """Whether torch can reduce accumulated gradients without another backward."""
        return False

    def _why_no_deferral(self) -> str:
        return ""

    def _inside_fix(self) -> str:
        return ""

    def _set_torch_manual(self, enabled: bool) -> None:
        raise NotImplementedError

    def _finalize_in_torch(self, async_op: bool) -> ReductionHandle | None:
        raise NotImplementedError

    def _apply_sync(self, recurse: bool) -> None:
        raise NotImplementedError


def _fsdp2_has_finalization(module: nn.Module) -> bool:
    finalize = getattr(module, "finalize_backward", None)
    if finalize is None or not hasattr(module, "set_manual_backward_finalization"):
        return False
    return "async_op" in inspect.signature(finalize).parameters


class _FSDP2Timing(_TorchTiming):
    kind = "torch FSDPModule"
    cadence_twin = "cadence.fully_shard"

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module, native=_fsdp2_has_finalization(module))

    def _defers(self) -> bool:
        return self.native_finalization

    def _why_no_deferral(self) -> str:
        return " (FSDP2's finalize_backward is torch 2.15's)"

    def _inside_fix(self) -> str:
        return " (torch's FSDP2 finalizes after backward completes), or use cadence.fully_shard"

    # torch's FSDP2 keeps a manual backward's iteration open even without sync.
    _nosync_opens = True

    def _pending_blocks(self, what: str) -> bool:
        # FSDP2 (as cadence.fully_shard) takes several syncing backwards per finalize.
        return what == "optimizer.step()"

    def _set_torch_manual(self, enabled: bool) -> None:
        self.module.set_manual_backward_finalization(enabled)  # type: ignore[operator]  # an FSDPModule method; nn.Module.__getattr__ types it Tensor | Module

    def _finalize_in_torch(self, async_op: bool) -> ReductionHandle | None:
        module: Any = self.module
        # torch's finalize needs its manual mode; a deferred reduction in automatic
        # mode turns it on for this one call (allowed: no backward is running).
        temporary = not self._manual
        if temporary:
            module.set_manual_backward_finalization(True)
        try:
            result = module.finalize_backward(async_op=async_op)
        finally:
            if temporary:
                module.set_manual_backward_finalization(False)
        if not async_op:
            self._finished()
            return None
        return self._handle_for(result.wait)

    def _apply_sync(self, recurse: bool) -> None:
        self.module.set_requires_gradient_sync(self._sync, recurse=recurse)  # type: ignore[operator]  # an FSDPModule method; nn.Module.__getattr__ types it Tensor | Module


def _ddp_has_finalization(module: nn.Module) -> bool:
    cls = type(module)
    verbs = ("finalize_backward", "require_manual_backward_finalization")
    return all(hasattr(cls, verb) for verb in verbs)


class _DDPTiming(_TorchTiming):
    kind = "torch DistributedDataParallel"
    cadence_twin = "cadence.DataParallel"
    module: DistributedDataParallel  # what gradient_timing() passes

    def __init__(self, module: DistributedDataParallel) -> None:
        super().__init__(module, native=_ddp_has_finalization(module))
        # See [Note: driving torch's wrappers with the timing verbs]: the decision
        # is taken when a backward starts, except under static_graph.
        self._at_backward = not getattr(module, "static_graph", False)
        self._user_flag = True
        module.register_forward_pre_hook(self._before_forward)

    def _why_no_deferral(self) -> str:
        return " (DDP reduces only from a backward's gradient hooks)"

    def _inside_fix(self) -> str:
        return ", or from a hook that runs once every bucket's gradients are ready"

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

    def _set_torch_manual(self, enabled: bool) -> None:
        ddp: Any = self.module
        # torch refuses even an unchanged value between a forward and its backward.
        if ddp.require_manual_backward_finalization != enabled:
            ddp.require_manual_backward_finalization = enabled

    def _finalize_in_torch(self, async_op: bool) -> ReductionHandle | None:
        # Reached only with a syncing backward pending in torch's manual mode.
        finish: Callable[[], None] = self.module.finalize_backward
        if not async_op:
            finish()
            self._finished()
            return None
        # DDP's finalize is blocking only: the handle runs it at wait(), while the
        # bucket all-reduces that backward launched stay in flight until then.
        return self._handle_for(finish)

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
    cached: GradientTiming | None = getattr(module, "_cadence_timing", None)
    if cached is not None:
        return cached
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    adapter: _TorchTiming
    if isinstance(module, FSDPModule):
        # fully_shard gives the module a class deriving from both FSDPModule and
        # the module's own class, so it is an nn.Module too.
        adapter = _FSDP2Timing(cast(nn.Module, module))
    elif isinstance(module, DistributedDataParallel):
        adapter = _DDPTiming(module)
    elif isinstance(module, nn.Module) or module is None:
        return None
    else:
        raise CadenceTypeError(f"gradient_timing() takes an nn.Module, got {type(module).__name__}")
    object.__setattr__(module, "_cadence_timing", adapter)
    return adapter
