"""`GradientTiming`: the gradient-timing verbs every cadence wrapper shares.

`cadence.DataParallel` and modules returned by `cadence.fully_shard` implement it,
so pipeline code and users drive either without knowing which they hold
(``isinstance(module, cadence.GradientTiming)``). The setters only set flags that
the hooks read later; no verb issues a collective except ``finalize_backward``.

Its Notes, each above the code it governs: `GradientTiming`:
[Note: one set of timing verbs]; ``GradientTiming.finalize_backward``:
[Note: finalize inside backward]; ``GradientTiming.split_backward``:
[Note: split backward parts].
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.hooks import RemovableHandle

from cadence._grad_timing import autograd as _autograd
from cadence.comm import ReductionHandle

__all__ = [
    "SPLIT_BACKWARD_PARTS",
    "GradientTiming",
    "ShardedTiming",
    "check_split_part",
    "refuse_inside_backward",
    "splits_backward",
]

SPLIT_BACKWARD_PARTS = ("input", "weight")


# [Note: one set of timing verbs]
# Each verb means the same on every wrapper; the methods below say what each does.
# One difference is kept, for a reason: several *syncing* backwards before one
# manual finalize. fully_shard accepts them (each reduction owns its buffers; the
# reduced shards add up in ``.grad``); DataParallel refuses the second backward,
# because its bucket buffers are reused by every backward and would be overwritten
# while in flight. Accumulate with sync off there instead (one reduction, fewer
# bytes on the wire).
@runtime_checkable
class GradientTiming(Protocol):
    """The verbs a data-parallel wrapper exposes, with one meaning on every wrapper."""

    @property
    def require_manual_backward_finalization(self) -> bool:
        """True: backward launches reductions but the caller must ``finalize_backward()``."""
        ...

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Set the flag above (or assign ``require_manual_backward_finalization``).

        Sticky; raises inside backward, because the end-of-backward callback reads it.
        """
        ...

    @property
    def should_finalize_after_backward(self) -> bool:
        """Read after forward: True when manual mode is on and the coming backward
        will launch reductions the caller must finalize."""
        ...

    def set_requires_gradient_sync(self, enabled: bool, *, recurse: bool = True) -> None:
        """Whether backwards reduce (True) or accumulate locally (False).

        Raises inside backward: a backward's sync decision is fixed for the whole
        backward (DataParallel takes it when the backward starts; fully_shard reads it
        per unit, so a flip mid-backward would reduce some units and not others).
        ``recurse`` reaches nested fully_shard units; DataParallel is one reduction unit
        with nothing nested, so both values act on the whole wrapper.
        """
        ...

    # [Note: finalize inside backward]
    # ``finalize_backward()`` may be called from a hook inside backward once every
    # reduction that backward will launch has launched (DataParallel: every bucket;
    # fully_shard: every unit that took part in the forward has run its post-backward,
    # so every reduce-scatter is issued). It then behaves as after backward: waits and
    # writes ``.grad``, and the end-of-backward callback finds nothing left to do.
    # Called earlier it raises, naming how many have launched.
    #
    # Why allow it: the optimizer-in-backward pattern. A hook on a tensor just upstream
    # of the wrapped module (an embedding's output) fires after the wrapped part's
    # backward, while the rest of backward (the embedding's gradient, a sparse
    # all-to-all) still runs; finalizing and stepping the dense optimizer there hides
    # the step behind that work. Nothing about sharding makes it unsafe: once the last
    # reduce-scatter is issued the gradients are final, exactly as for buckets.
    # Why refuse earlier: a reduction not launched yet would have to be launched by the
    # finalize, out of the backward's order. Its gradient is not final (a later hook
    # still adds to it), and ranks whose hooks run at different points would issue
    # collectives in different orders.
    def finalize_backward(self, *, async_op: bool = False) -> ReductionHandle | None:
        """Finish every pending reduction and write the reduced ``.grad``.

        Follows the current flags: a deferred reduction of gradients accumulated with
        sync off is paid here once sync is on again. Blocking, it returns None; with
        ``async_op=True`` it always returns a `ReductionHandle`, already completed when
        nothing was pending, so callers never test for None. Inside backward, see
        [Note: finalize inside backward].
        """
        ...

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Make ``optimizer.step()`` raise while the gradients are not the reduced ones:
        while a handle is unwaited, while reductions a backward launched are not
        finalized, and after a failed backward until ``reset_iter_state()``."""
        ...

    def reset_iter_state(self) -> None:
        """Drop the state of a step that raised (on every rank)."""
        ...

    def overlap_optimizer(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        """Step each reduced part (bucket, unit) as it completes; ``opt.step()`` finishes."""
        ...

    # [Note: split backward parts]
    # A zero-bubble schedule runs one microbatch's backward as two separate autograd
    # calls (or more): I computes the gradients of the module's *inputs* and no
    # parameter gradient; W, later, the parameter gradients (see
    # ``cadence/pipeline/runtime/split_backward.py``). Without help a wrapper would
    # take each call for a whole backward: fully_shard would finish (and reshard) its
    # units at the end of I, so W would find the parameters' storage freed; and
    # DataParallel would arm a reduction window in I that no gradient ever fills.
    #
    # - ``split_backward("input")``: the backward inside produces no parameter
    #   gradient. Units are unsharded as in any backward (the weight part needs them)
    #   but not finished: no post-backward, no reshard, nothing reduced or
    #   accumulated; DataParallel arms no window.
    # - ``split_backward("weight")``: every autograd call inside together is the
    #   parameter half of *one* backward. Each parameter's post-accumulate-grad hook
    #   fires once, so reductions launch per bucket / per unit as soon as their
    #   gradients are ready, exactly as in a full backward, following the same flags;
    #   fully_shard first re-gathers any unit a forward resharded in between. At exit
    #   the backward ends as a full one would (units whose hooks fired are finished,
    #   automatic mode finalizes).
    #
    # Raises inside a backward, and when parts nest.
    def split_backward(self, part: str) -> AbstractContextManager[None]:
        """Mark the autograd calls inside as one part of a split backward, as
        zero-bubble pipeline schedules run it; see [Note: split backward parts]."""
        ...


@runtime_checkable
class ShardedTiming(GradientTiming, Protocol):
    """What a sharded wrapper (a `cadence.fully_shard` module) adds to the verbs: when
    its parameters are gathered and freed. A pipeline whose schedule places UNSHARD
    and RESHARD drives these, and turns the wrapper's own reshard flags off."""

    def unshard(self, *, async_op: bool = False) -> Any:
        """Gather the unit's parameters; with ``async_op`` return a handle to wait."""
        ...

    def reshard(self) -> None:
        """Free the unit's gathered parameters (its shards stay)."""
        ...

    def set_reshard_after_forward(self, enabled: bool, *, recurse: bool = True) -> None:
        """Whether the unit frees its gathered parameters after each forward."""
        ...

    def set_reshard_after_backward(self, enabled: bool, *, recurse: bool = True) -> None:
        """Whether the unit frees its gathered parameters after each backward."""
        ...


def splits_backward(timing: GradientTiming) -> bool:
    """Whether ``timing`` can run a split (I/W) backward: every cadence wrapper can; the
    adapters of torch's own wrappers (`cadence.gradient_timing`) declare
    ``splits_backward = False``, since torch ends a backward at every autograd call."""
    return bool(getattr(timing, "splits_backward", True))


def refuse_inside_backward(verb: str, why: str, error: type[Exception]) -> None:
    """Raise ``error`` when a setter of the timing verbs is called inside backward."""
    if _autograd.in_backward():
        raise error(
            f"{verb} was called inside backward (from a hook?): {why} "
            "Fix: call it before the forward whose backward it should govern."
        )


def check_split_part(part: str, current: str | None, error: type[Exception]) -> None:
    """Validate a ``split_backward(part)`` entry; see [Note: split backward parts]."""
    if part not in SPLIT_BACKWARD_PARTS:
        raise error(f"split_backward({part!r}): the part must be one of {SPLIT_BACKWARD_PARTS}")
    if current is not None:
        raise error(
            f"split_backward({part!r}) inside split_backward({current!r}): the parts of a "
            "split backward run one after the other, not nested."
        )
    refuse_inside_backward(f"split_backward({part!r})", "a part spans whole autograd calls.", error)
