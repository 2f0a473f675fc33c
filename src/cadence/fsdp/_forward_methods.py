"""``register_fsdp_forward_method``: a unit's other entry points gather like ``forward``."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from cadence.fsdp._errors import FullyShardValueError
from cadence.fsdp._fully_shard import FullyShardedModule

__all__ = ["register_fsdp_forward_method"]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` under the unit's forward hooks, as FSDP2's function.

    A unit gathers its parameters only around ``forward``; a model whose training step
    calls another method (``vit.forward_features(x)``, ``model.generate``) would read
    sharded parameters there. After this call the method unshards the unit (and
    prefetches, and casts inputs under mixed precision) before it runs and reshards it
    after, and gradients flowing back through its outputs reduce as ``forward``'s do.

    A module that ``fully_shard`` did not wrap is left alone, as FSDP2 does, so a script
    can call this with sharding on or off.
    """
    if not isinstance(module, FullyShardedModule):
        return
    method = getattr(module, method_name, None)
    if not callable(method):
        raise FullyShardValueError(
            f"{type(module).__name__} has no method {method_name!r} to register; "
            "pass the name of one of its methods, such as 'forward_features'."
        )
    unit = module._cadence_unit

    @functools.wraps(method)
    def gathered(*args: Any, **kwargs: Any) -> Any:
        runtime = module._runtime  # read live: a later fully_shard call may replace it
        args, kwargs = runtime.pre_forward(unit, args, kwargs)
        return runtime.post_forward(unit, method(*args, **kwargs))

    # An instance attribute, as FSDP2: the class (shared by every wrapped module of the
    # same type) keeps its method; only this module's calls are gathered.
    setattr(module, method_name, gathered)
