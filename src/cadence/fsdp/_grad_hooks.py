"""Post-accumulate-grad hooks that users register on the sharded parameters.

[Note: hooks on sharded parameters]
``p.register_post_accumulate_grad_hook(hook)`` on a parameter of a sharded module (the
DTensor that ``model.parameters()`` returns and the optimizer steps) is how
optimizer-in-backward scripts step each parameter as soon as its gradient is ready.
Autograd never runs those hooks: it differentiates the unsharded parameters, and the
sharded parameter's ``.grad`` is written by the unit after the reduce-scatter. FSDP2
therefore calls them itself, right after it writes each reduced sharded gradient
(``foreach_reduce`` in torch's ``_fsdp_collectives.py``, 2.13 and 2.15 alike), and cadence
does the same at the same point: once per parameter per reduction written, with
``p.grad`` the reduced sharded gradient, never in a no-sync backward (nothing is written
then) nor for a reduction held back (HSDP ``set_requires_all_reduce(False)``).
"""

from __future__ import annotations

import torch

__all__ = ["run_post_accumulate_grad_hooks"]


def run_post_accumulate_grad_hooks(param: torch.Tensor) -> None:
    """Call ``param``'s post-accumulate-grad hooks, in registration order, as FSDP2 does."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    for hook in list((hooks or {}).values()):  # a hook may remove itself
        hook(param)
