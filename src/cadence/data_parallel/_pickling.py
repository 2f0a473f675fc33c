"""How a `DataParallel` wrapper pickles: ``torch.save(model)``, ``copy.deepcopy``.

[Note: pickling a wrapper]
A wrapper holds a process group, a reducer with its buckets, hooks on every
parameter and an event log: nothing of that is data. torch DDP pickles its
``__dict__`` without the group and the reducer, and its ``__setstate__`` rebuilds
both on the default process group; a script that saves the wrapped model or deep
copies it relies on that. Here the pickled state is what the constructor needs: the
wrapped module, the constructor's arguments and the flags a user may have set since
(manual finalization, held buckets, gradient sync, buffer broadcast). Unpickling calls the
constructor again with ``init_sync=False``, so it issues no collective, exactly as
DDP's rebuild issues none, and may run on one rank alone (``torch.load`` on rank 0).

What cannot travel is refused by name, never dropped: a wrapper on another group
than the default one (DDP refuses too), a comm hook, optimizers stepped per bucket,
and reductions in flight. The event log is the process's own: the rebuilt wrapper
starts a new bounded one, as a fresh wrapper does.
"""

from __future__ import annotations

from typing import Any

from cadence.data_parallel._errors import DataParallelError

__all__ = ["FLAGS", "check_picklable", "pickled_state"]

# Flags a user may set after construction, with the attribute that holds each.
FLAGS = (
    "require_manual_backward_finalization",
    "held_buckets",  # after the manual flag, which it requires
    "holds_only_while_busy",  # after the count it applies to
    "require_backward_grad_sync",
    "require_forward_param_sync",
    "broadcast_buffers",
)

_FIX = "Save the wrapped module instead (torch.save(model.module) or its state_dict()) and wrap it again after loading."


def check_picklable(dp: Any) -> None:
    """Raise, naming the cause, where the wrapper holds what a pickle cannot carry."""
    why = None
    if not dp._comm.is_default_group:
        why = "it reduces over a process group other than the default one (torch DDP refuses this too)"
    elif dp._reducer.comm_hook is not None:
        why = "a comm hook is registered (a function bound to this process's state)"
    elif dp._overlap.steppers:
        why = "optimizers are stepped per bucket (overlap_optimizer) and belong to this process"
    elif dp._reducer.pending or dp._reducer.accumulating:
        why = "gradient reductions are pending or owed; finalize_backward() first"
    if why is not None:
        raise DataParallelError(f"DataParallel cannot be pickled or deep-copied: {why}. {_FIX}")


def pickled_state(dp: Any, init_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The state that rebuilds ``dp`` (see [Note: pickling a wrapper])."""
    check_picklable(dp)
    return {
        "module": dp.module,
        "init_kwargs": init_kwargs,
        "flags": {name: getattr(dp, name) for name in FLAGS},
    }
