"""Step an optimizer in parts, with its own ``step``, as each part's gradients arrive.

[Note: stepping an optimizer in parts]
A wrapper that reduces gradients in buckets can update a bucket's parameters as soon
as that bucket's reduction completes, while later buckets are still on the wire. This
module does the optimizer side of that, knowing nothing of buckets or wrappers: the
owner names its *parts* (lists of parameters) and calls `PartialStepper.step_part`
when a part's gradients are final; the user's ``opt.step()`` (replaced on the
instance by `PartialStepper.install`) first lets the owner finish its pending work
(which steps the remaining parts), then steps whatever the optimizer holds that no
part stepped, and returns.

- The optimizer's own math. A part is stepped by narrowing each param group's
  ``params`` to the part's members (in the group's order) and calling the class's
  undecorated ``step``; the group dicts, their hyperparameters and ``optimizer.state``
  (keyed by parameter) are the optimizer's own, so state, ``state_dict()`` and
  ``load_state_dict()`` are untouched, and the lr a part is stepped with is the
  group's lr at that moment. SGD, Adam and AdamW update each parameter from its own
  gradient and state only, so stepping parts gives the same bits as one step of all,
  with the same ``foreach``/``fused`` setting (tested). Anything not in that
  allowlist (exact classes: a subclass may override ``step``) is refused with the
  reason: LBFGS and anything with a closure re-evaluates the loss over every
  parameter; Adafactor, Adagrad, RMSprop, ... are per-parameter too, but unproven
  here. ``differentiable=True`` is refused (a step in the autograd graph).
- One step per user step. Step pre-hooks (global and the optimizer's) run once, just
  before the first part is stepped: no parameter has changed yet, but later parts'
  gradients are still being reduced, so a pre-hook must not read gradients. Post-hooks
  run once, when ``opt.step()`` returns. ``optimizer._opt_called`` is set (LR
  schedulers read it), and the replaced ``step`` is marked as their wrapper, so a
  scheduler built before or after works unchanged: it changes the lr between
  ``opt.step()`` and the next backward, and parts of step k are stepped after the
  backward of step k starts, so every part of a step sees that step's lr.
- Never silently wrong. What the plain loop does *between* backward and
  ``opt.step()`` cannot be honoured once parts were stepped, so it is detected at
  ``opt.step()`` and raised, naming the fix: a gradient of a stepped parameter
  modified in place or replaced (``clip_grad_norm_``, a GradScaler's ``unscale_``,
  ``zero_grad``; seen by the gradient's identity and version counter, and for a
  DTensor gradient, whose foreach in-place ops move no counter, by its values), or a
  hyperparameter changed (an lr set right before ``opt.step()``). Clipping by the
  global norm is offered instead (``max_grad_norm``): it needs every reduced
  gradient, so with it no part is stepped early and ``opt.step()`` clips (as
  ``clip_grad_norm_`` over the optimizer's parameters, in param-group order) and then
  steps everything; the reductions still overlap backward, the optimizer does not.
- A part stepped twice in one step (a second synced backward before ``opt.step()``)
  raises before the second update.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch.optim import optimizer as _torch_optimizer

from cadence.errors import (
    CadenceTypeError,
    CadenceValueError,
    OverlapStepError,
)

__all__ = ["OverlapHandle", "OverlapStepError", "PartialStepper"]

# Exact classes whose step updates each parameter from its own gradient and state.
_PER_PARAMETER: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    return bool(a == b)


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its width: equal bits compare equal, NaN included."""
    if t.is_floating_point() or t.is_complex():
        return t.view(t.dtype.to_real()).view(_INT_OF_SIZE[t.dtype.to_real().itemsize])
    return t


class _Used:
    """A gradient an early step read, and how to tell it was changed afterwards.

    A plain tensor's in-place changes move its version counter. A DTensor gradient
    (fully_shard) is changed through its local tensor inside DTensor's dispatch, and a
    foreach in-place op (``clip_grad_norm_``'s ``_foreach_mul_``, a GradScaler's
    unscale) moves neither counter, so its local values are kept and compared: one
    copy of the stepped gradient shards, held until ``opt.step()``.
    """

    __slots__ = ("grad", "local", "param", "version")

    def __init__(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        self.param = param
        self.grad = grad
        self.version = grad._version
        local = getattr(grad, "_local_tensor", None)
        self.local = _bits(local).clone() if isinstance(local, torch.Tensor) else None

    def changed(self) -> bool:
        g = self.grad
        if self.param.grad is not g or g._version != self.version:
            return True
        if self.local is None:
            return False
        local = g._local_tensor  # type: ignore[attr-defined]  # a DTensor grad; torch types .grad as Tensor
        return local.shape != self.local.shape or not torch.equal(_bits(local), self.local)


def _snapshot(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def check_optimizer(optimizer: Any, who: str, part: str = "bucket") -> None:
    """Refuse, with the reason, an optimizer whose step cannot be split into parts."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CadenceTypeError(
            f"{who}.overlap_optimizer() takes a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    names = ", ".join(c.__name__ for c in _PER_PARAMETER)
    if type(optimizer) not in _PER_PARAMETER:
        raise CadenceValueError(
            f"{who}.overlap_optimizer() cannot step {type(optimizer).__name__} in parts: "
            f"it steps only {names} (exact classes), whose update of a parameter reads that "
            f"parameter's gradient and state alone, so stepping each {part} as its reduction "
            "completes gives the same bits as one step. An optimizer that needs every "
            "gradient before any update (LBFGS and any closure-based step, anything "
            "normalizing across parameters) or is not proven per-parameter here (a subclass "
            "may override step) is refused. Fix: call opt.step() after backward as usual, "
            "without overlap_optimizer."
        )
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable", False):
            raise CadenceValueError(
                f"{who}.overlap_optimizer(): param group {i} has differentiable=True, whose "
                "step is recorded by autograd; overlapped steps are not. Fix: "
                "differentiable=False, or step without overlap_optimizer."
            )


class PartialStepper:
    """One optimizer, stepped part by part; ``opt.step()`` finishes the rest.

    ``finish_pending`` is the owner's: called first by ``opt.step()``, it completes
    whatever reductions are pending (stepping their parts). ``max_grad_norm``: clip
    by the global norm at ``opt.step()``; then no part is stepped early. ``part`` is
    what the owner calls a part in messages ("bucket", "unit").
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        who: str,
        finish_pending: Callable[[], None],
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
        part: str = "bucket",
    ) -> None:
        check_optimizer(optimizer, who, part)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise CadenceValueError(
                f"{who}.overlap_optimizer(max_grad_norm={max_grad_norm!r}): pass a positive "
                "number, or None for no clipping"
            )
        raw = type(optimizer).step
        if getattr(raw, "hooked", False):
            # torch's hook-running wrapper (functools.wraps): the hooks are run here.
            raw = raw.__wrapped__  # type: ignore[attr-defined]  # torch types step as a plain method
        self.optimizer = optimizer
        self.who = who
        self.part = part
        self.max_grad_norm = max_grad_norm
        self.norm_type = norm_type
        self._raw_step: Callable[..., Any] = raw
        self._finish_pending = finish_pending
        self._parts: list[list[torch.Tensor]] = []
        self._plan_key: tuple[Any, ...] = ()
        self._plan: list[list[list[torch.Tensor]]] = []  # per part, per group: members
        self._rest: list[list[torch.Tensor]] = []  # per group: members of no part
        # Per step: what was stepped early, with the gradient it used and its version.
        self._stepped_parts: set[int] = set()
        self._used: list[_Used] = []
        self._hparams: list[dict[str, Any]] | None = None
        self._installed: Any = None
        self._had_step_attr = False

    @property
    def steps_early(self) -> bool:
        """False with ``max_grad_norm``: the global norm needs every reduced gradient."""
        return self.max_grad_norm is None

    def set_parts(self, parts: Sequence[Iterable[torch.Tensor]]) -> None:
        self._parts = [list(p) for p in parts]
        self._plan_key = ()

    # -- the plan: each part's members, per param group, in the group's order -----

    def _refresh_plan(self) -> None:
        groups = self.optimizer.param_groups
        key = tuple((id(g), id(g["params"]), len(g["params"])) for g in groups)
        if key == self._plan_key:
            return
        part_of = {id(p): k for k, part in enumerate(self._parts) for p in part}
        self._plan = [[[] for _ in groups] for _ in self._parts]
        self._rest = [[] for _ in groups]
        for gi, g in enumerate(groups):
            for p in g["params"]:
                k = part_of.get(id(p))
                (self._rest[gi] if k is None else self._plan[k][gi]).append(p)
        self._plan_key = key

    def _step_members(self, members: list[list[torch.Tensor]]) -> None:
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g, m in zip(groups, members):
                g["params"] = m
            self._raw_step(self.optimizer)
        finally:
            for g, s in zip(groups, saved):
                g["params"] = s

    # -- hooks ---------------------------------------------------------------------

    def _begin(self) -> None:
        """First update of this step: snapshot hyperparameters, run the pre-hooks."""
        if self._hparams is not None:
            return
        opt = self.optimizer
        self._hparams = [
            {k: _snapshot(v) for k, v in g.items() if k != "params"} for g in opt.param_groups
        ]
        for hook in itertools.chain(
            _torch_optimizer._global_optimizer_pre_hooks.values(),
            opt._optimizer_step_pre_hooks.values(),
        ):
            result = hook(opt, (opt,), {})
            if result is not None and (tuple(result[0][1:]) != () or result[1] != {}):
                raise CadenceValueError(
                    f"{self.who}.overlap_optimizer(): a step pre-hook returned new step "
                    "arguments; an overlapped step takes none (no closure). Fix: remove the "
                    "hook, or step without overlap_optimizer."
                )

    def step_part(self, index: int) -> None:
        """Step part ``index`` now: its gradients are final for this step."""
        if not self.steps_early:
            return
        if index in self._stepped_parts:
            raise OverlapStepError(
                f"{self.who}.overlap_optimizer(): a second synced backward reduced gradients "
                "whose parameters were already stepped in this step, before opt.step(). Fix: "
                "accumulate with no_sync() / require_backward_grad_sync=False, and call "
                "opt.step() after the one synced backward."
            )
        self._refresh_plan()
        members = self._plan[index]
        self._begin()
        self._stepped_parts.add(index)
        if not any(members):
            return
        self._step_members(members)
        for m in members:
            for p in m:
                g = p.grad
                if g is not None:
                    self._used.append(_Used(p, g))

    @property
    def mid_step(self) -> bool:
        """Some parts were stepped and ``opt.step()`` has not finished the step yet."""
        return bool(self._stepped_parts)

    def _check_untouched(self) -> None:
        changed = [u.param for u in self._used if u.changed()]
        if changed:
            n = len(self._stepped_parts)
            raise OverlapStepError(
                f"{self.who}.overlap_optimizer(): the gradients of {len(changed)} parameter(s) "
                f"were changed after their {self.part} was stepped ({n} {self.part}(s) already updated "
                "with the reduced gradients). clip_grad_norm_, a GradScaler's unscale_, or "
                "zero_grad between backward and opt.step() cannot apply to an overlapped step: "
                "those parameters are no longer what the plain loop would give. Fix: pass "
                "max_grad_norm= to overlap_optimizer for clipping, do not use a GradScaler "
                "with it, and call zero_grad after opt.step()."
            )
        assert self._hparams is not None
        for i, (g, before) in enumerate(zip(self.optimizer.param_groups, self._hparams)):
            for k, v in before.items():
                if k not in g or not _same(g[k], v):
                    raise OverlapStepError(
                        f"{self.who}.overlap_optimizer(): param group {i}'s {k!r} changed from "
                        f"{v!r} to {g.get(k)!r} after {len(self._stepped_parts)} {self.part}(s) of "
                        "this step were stepped with the old value. Fix: change hyperparameters "
                        "(scheduler.step(), a manual lr) after opt.step() and before the next "
                        "backward."
                    )

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """The user's ``opt.step()``: finish pending work, step the rest, run post-hooks."""
        if closure is not None:
            raise CadenceValueError(
                f"{self.who}.overlap_optimizer(): opt.step(closure) re-evaluates the loss, "
                "which needs every parameter before any update. Fix: step without a closure, "
                "or without overlap_optimizer."
            )
        opt = self.optimizer
        try:
            self._finish_pending()
            if self._stepped_parts:
                self._check_untouched()
            self._refresh_plan()
            if self._stepped_parts:
                members = [list(m) for m in self._rest]
                for k, plan in enumerate(self._plan):
                    if k not in self._stepped_parts:
                        for m, part in zip(members, plan):
                            m.extend(part)
            else:
                members = [g["params"] for g in opt.param_groups]
                if self.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(
                        [p for m in members for p in m if p.grad is not None],
                        self.max_grad_norm,
                        norm_type=self.norm_type,
                    )
            self._begin()
            if any(members):
                self._step_members(members)
        finally:
            self._stepped_parts.clear()
            self._used.clear()
            self._hparams = None
        opt._opt_called = True  # type: ignore[attr-defined]  # LR schedulers read it
        for hook in itertools.chain(
            opt._optimizer_step_post_hooks.values(),
            _torch_optimizer._global_optimizer_post_hooks.values(),
        ):
            hook(opt, (opt,), {})

    # -- installing the step -------------------------------------------------------

    def install(self) -> None:
        """Make ``optimizer.step`` this stepper's `step` (an instance attribute)."""
        opt = self.optimizer

        def step(_opt: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> None:
            self.step(closure)

        # LR schedulers wrap opt.step once and check this mark; the step sets
        # _opt_called itself, so one built before or after works unchanged.
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # a mark on a function
        self._had_step_attr = "step" in vars(opt)
        self._previous = vars(opt).get("step")
        self._installed = types.MethodType(step, opt)
        opt.step = self._installed  # type: ignore[method-assign]  # an instance attribute, on purpose

    def remove(self) -> None:
        """Give ``optimizer.step`` back (call between steps)."""
        opt = self.optimizer
        if vars(opt).get("step") is self._installed:
            if self._had_step_attr:
                opt.step = self._previous  # type: ignore[method-assign, assignment]  # the instance attribute we replaced
            else:
                del opt.step
        self._installed = None


class _StepperOwner(Protocol):
    def remove(self, stepper: PartialStepper) -> None: ...


class OverlapHandle:
    """Returned by ``overlap_optimizer`` (DataParallel's and fully_shard's);
    ``remove()`` gives ``opt.step`` back."""

    def __init__(self, owner: _StepperOwner, stepper: PartialStepper) -> None:
        self._owner = owner
        self._stepper = stepper

    def remove(self) -> None:
        self._owner.remove(self._stepper)
