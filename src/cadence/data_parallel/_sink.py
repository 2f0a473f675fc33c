"""The wrapper's autograd side: the node that marks where a backward starts, and the
walk that finds the parameters a forward used (``find_unused_parameters``)."""

from __future__ import annotations

from typing import Any

import torch

from cadence.data_parallel._reducer import ForwardToken, Reducer

__all__ = ["Sink", "used_params"]


class Sink(torch.autograd.Function):
    """Identity on the wrapper's outputs whose backward marks the start of a backward.

    It runs before any wrapped parameter's gradient, in the graph task of the
    caller's ``backward()``, which is where the window is armed and the
    end-of-backward callback is queued (never from a nested reentrant task).
    """

    @staticmethod
    def forward(ctx: Any, reducer: Reducer, token: ForwardToken, *tensors: torch.Tensor) -> Any:
        ctx.reducer = reducer
        ctx.token = token
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.reducer.begin_backward(ctx.token)
        return (None, None, *grads)


def used_params(outputs: list[torch.Tensor], index_of: dict[int, int]) -> set[int]:
    """Parameter indices reachable from ``outputs`` through the autograd graph."""
    used: set[int] = set()
    seen: set[Any] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None and id(var) in index_of:
            used.add(index_of[id(var)])
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return used
