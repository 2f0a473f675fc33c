"""Placeholder gradients: ``.grad`` cannot be read before ``finalize_backward()`` writes it.

[Note: gradients appear at finalization]
With manual finalization (or FSDP2's ``set_is_last_backward(False)``), a backward
returns while its reductions are still in flight. Until ``finalize_backward()`` (or
its handle's ``wait()``) writes the reduced values, ``.grad`` would otherwise hold
this rank's *local* gradient (DataParallel) or the previous step's value
(fully_shard). ``clip_grad_norm_``, ``optimizer.step`` or a logging ``p.grad.norm()``
would then silently compute on the wrong numbers, and only on some ranks.

The choice: between the end of such a backward and the write-back, every wrapped
parameter's ``.grad`` is a `PendingGrad`: a tensor with the gradient's shape, dtype
and device but no storage, whose every operation raises
`UnreducedGradientError`, naming ``finalize_backward()``. The real gradient tensor
is kept aside and put back, unchanged, right before the reduced values are written
into it, so no memory is allocated or copied. Checks that only look at metadata
(``p.grad is None``, ``p.grad.shape``) keep working.

Why not a guarded accessor (a Parameter subclass with a ``grad`` property): it
would change every parameter's class, which torch.compile guards and pickles, and
cost a Python call on every ``.grad`` read in every mode. Why not ``.grad = None``:
``clip_grad_norm_`` skips None gradients and returns a norm of 0, which is exactly
the silent wrong result to avoid.

The cost: two ``.grad`` assignments per parameter per manual step (a few
microseconds per hundred parameters), and nothing at all in automatic mode, where
backward returns with the gradients already written.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from cadence.errors import UnreducedGradientError

__all__ = ["GradGuard", "PendingGrad", "UnreducedGradientError"]


class PendingGrad(torch.Tensor):
    """Stands in ``.grad`` until the reduced gradient is written; any use raises."""

    _cadence_name: str
    _cadence_owner: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str, owner: str) -> PendingGrad:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            like.shape,
            strides=like.stride(),
            dtype=like.dtype,
            device=like.device,
            layout=like.layout,
            requires_grad=False,
        )
        out._cadence_name = name
        out._cadence_owner = owner
        return out

    # torch's documented idiom for a subclass without __torch_function__; torch
    # annotates this C function and Tensor.__torch_function__ differently.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's idiom (see above)

    # The signature torch documents for subclasses (args and kwargs defaulted);
    # torch annotates Tensor's own, disabled one without the defaults.
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's documented signature (see above)
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        pending = next(
            (a for a in [*args, *(kwargs or {}).values()] if isinstance(a, PendingGrad)), None
        )
        if pending is None:  # a list argument (foreach ops, clip_grad_norm_)
            pending = next(
                (
                    x
                    for a in args
                    if isinstance(a, (list, tuple))
                    for x in a
                    if isinstance(x, PendingGrad)
                ),
                None,
            )
        name = pending._cadence_name if pending is not None else "?"
        owner = pending._cadence_owner if pending is not None else "the wrapper"
        raise UnreducedGradientError(
            f"the gradient of '{name}' is not reduced yet ({func} was called on it): "
            f"{owner}'s backward launched the gradient reductions but finalize_backward() "
            "has not written them into .grad. Clipping, stepping or logging it now would "
            "use a value that is not the reduced gradient. Fix: call model.finalize_backward() (or wait the "
            "handle of finalize_backward(async_op=True)) first."
        )

    def __repr__(self) -> str:  # type: ignore[override]  # Tensor.__repr__ also takes tensor_contents
        return f"PendingGrad({self._cadence_name!r}: call finalize_backward() to read it)"


def _placeholder(p: torch.Tensor, name: str, owner: str) -> torch.Tensor:
    if isinstance(p, DTensor):
        # A DTensor around the placeholder: DTensor refuses to mix with plain tensors,
        # and runs each op on the local tensor, which then raises the message above.
        local = PendingGrad(p._local_tensor, name, owner)
        return DTensor(local, p._spec, requires_grad=False)
    return PendingGrad(p, name, owner)


class GradGuard:
    """Swaps ``.grad`` of a set of parameters for `PendingGrad` and back."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._placeholders: dict[int, torch.Tensor] = {}  # made once per parameter
        self._stash: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    @property
    def active(self) -> bool:
        return bool(self._stash)

    def poison(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, p in named:
            key = id(p)
            if key in self._stash:
                continue
            placeholder = self._placeholders.get(key)
            if placeholder is None:
                placeholder = self._placeholders[key] = _placeholder(p, name, self.owner)
            self._stash[key] = (p, p.grad)
            p.grad = placeholder

    def restore(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Put the real gradients back (of ``params``, or of every guarded parameter)."""
        keys = list(self._stash) if params is None else [id(p) for p in params]
        for key in keys:
            entry = self._stash.pop(key, None)
            if entry is None:
                continue
            p, grad = entry
            if p.grad is self._placeholders[key]:  # else the caller replaced it: keep theirs
                p.grad = grad
