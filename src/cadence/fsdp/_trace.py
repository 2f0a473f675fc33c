"""A fully_shard module's forward traced outside its hooks (for `cadence.precompile`).

[Note: precompiling a fully_shard forward]
``precompile_module(unit_module, ...)`` compiles ``type(module).forward`` with the
module as an argument and installs the result as the instance's ``forward``; calling
``module(...)`` then runs fully_shard's hooks eagerly around the compiled graph. The
graph reads ``module._parameters[name]`` at every call, and at that moment the
pre-forward hook has registered the unit's unsharded Parameters: the same objects
every step (views into the unit's flat buffer, whose storage is freed after the step
and refilled by the next all-gather). So the graph computes with this step's
all-gathered values, its backward fills the unsharded ``.grad`` the post-accumulate
hooks reduce, and a reshard-after-forward unit whose storage is refilled for backward
gives the saved tensors back their values, as in eager. What has to hold:

- The trace sees what the forward sees: the unsharded plain Parameters (between steps
  the sharded DTensors are registered; a graph traced on those would not match the
  call), and the inputs after the unit's mixed-precision cast. `traced_forward`
  unshards the unit for the compile and then restores its state, so afterwards
  ``module.parameters()`` are the sharded Parameters again, the ones an optimizer must
  hold: an optimizer built while the unit is unsharded steps the unsharded views,
  which the next all-gather overwrites, and the model never trains.
- No nested unit inside the compiled forward: its hooks (an all-gather, a storage
  resize, a reduce-scatter in backward) would have to run inside the graph. Refused;
  precompile the innermost units instead and leave the outer forward eager.
- A function that calls a unit (``precompile(step, (model, x))``) runs the unit's
  hooks inside the graph too: refused, with ``precompile_module`` as the fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from cadence.fsdp._errors import FullyShardError
from cadence.fsdp._fully_shard import FullyShardedModule
from cadence.fsdp._root_runtime import TrainingState
from cadence.fsdp._unit import ShardedState

__all__ = ["refusal", "traced_forward"]


def _units_inside(module: nn.Module) -> list[str]:
    return [
        name or type(module).__name__
        for name, sub in module.named_modules()
        if sub is not module and isinstance(sub, FullyShardedModule)
    ]


def refusal(obj: Any, what: str, *, forward_only: bool = False) -> str | None:
    """Why ``obj`` (an argument of a compiled function) cannot be traced, or None.

    A module that holds a fully_shard unit is refused; a module that is one is refused
    unless `traced_forward` is tracing it, or ``forward_only`` (only its forward,
    not its ``__call__``, is to be compiled: `traced_forward` will hold it).
    """
    if not isinstance(obj, nn.Module):
        return None
    nested = _units_inside(obj)
    if nested:
        shown = ", ".join(nested[:4]) + (", ..." if len(nested) > 4 else "")
        return (
            f"{what} ({type(obj).__name__}) contains fully_shard units ({shown}) whose "
            "hooks (all-gathers, reduce-scatters) would run inside the compiled graph. "
            "Fix: precompile_module each innermost fully_shard module (e.g. each block) "
            "and leave the outer forward eager"
        )
    if isinstance(obj, FullyShardedModule) and not (forward_only or obj._cadence_unit.tracing):
        return (
            f"{what} ({type(obj).__name__}) is a fully_shard module: calling it runs "
            "fully_shard's hooks (all-gathers, reduce-scatters) inside the compiled "
            "graph. Fix: cadence.precompiling.precompile_module(module, example_args) "
            "compiles its forward and keeps the hooks eager"
        )
    return None


@contextlib.contextmanager
def traced_forward(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Hold ``module`` as its forward sees it; yield the inputs as its forward gets them.

    See [Note: precompiling a fully_shard forward]. A plain module is yielded as is.
    Unsharding is an all-gather over the unit's shard group: every rank of that group
    must enter together, as they do when they call precompile together.
    """
    if not isinstance(module, FullyShardedModule):
        yield args, kwargs
        return
    runtime = module._runtime
    runtime.check_no_pending_handle("precompile_module()")
    runtime.check_backward_finished("precompile_module()")
    if runtime.state is not TrainingState.IDLE:
        raise FullyShardError(
            "precompile_module() during forward or backward; call it between steps."
        )
    unit = module._cadence_unit
    was_sharded = unit.state is ShardedState.SHARDED
    unit.unshard(async_op=False)
    runtime.note_unsharded()
    unit.tracing = True
    try:
        yield unit.mp_policy.cast_inputs(args, kwargs)
    finally:
        unit.tracing = False
        if was_sharded:
            unit.reshard()
