"""The parameters and buffers DataParallel was built around, looked up and checked live.

[Note: module methods after wrapping]
DataParallel binds its reduction to parameter *objects*: a post-accumulate hook on
each wrapped parameter, bucket buffers of their dtype and device, bucket views
adopted as ``.grad``, and the set of parameters that required grad when it was
built (the only ones reduced). nn.Module methods called after wrapping, per method:

- Honoured: conversions that keep every wrapped parameter's dtype and device
  (``to_empty`` onto the same device, ``cpu()``/``to(device)`` where the model is,
  ``float()`` on a float32 model, ``share_memory()``, ``_apply``). nn.Module
  converts a plain parameter in place (``param.data = ...``), so the objects, their
  hooks and their buckets stay. Buffers however are replaced by new objects, so
  the forward's broadcast looks them up by name each time (as torch DDP does)
  rather than keeping the objects found at construction, which would silently stop
  synchronizing a replaced buffer from rank 0. Values a method re-initialises are
  not re-broadcast (rank 0's were broadcast once, at construction, as in DDP): seed
  every rank alike before ``reset_parameters()``.
- Refused before anything changes: a conversion that changes a wrapped parameter's
  dtype or device (``to(dtype)``, ``double``/``half``/``bfloat16``, ``to_empty`` or
  ``to`` onto another device), since the buckets hold the old ones (torch DDP goes
  on training without reducing there, measured with torch 2.13 and 2.15); and
  ``load_state_dict(assign=True)`` on the wrapper, which would register new objects
  that no hook watches.
- Refused where it shows, when made where the wrapper does not see it happen (on
  ``dp.module`` or a submodule): a parameter unfrozen after wrapping (it would train
  on local gradients only, silently drifting the replicas apart, as torch DDP does)
  by the next forward, which checks the parameters that were frozen when wrapped
  (usually none, so the forward pays nothing per wrapped parameter); a parameter
  frozen or replaced after wrapping by the end of the next backward, where it shows
  as a gradient that never came; a dtype or device change where its gradient meets
  its bucket. Those errors already existed; `Replica.explain` makes them name what
  happened (the check runs only on the error path, off the per-parameter hot path
  of [Note: the hook's fast path]).

Each message names the parameter or the method and the fix: do it before wrapping,
or wrap the model again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cadence._modules.conversions import conversion_target
from cadence.data_parallel._errors import DataParallelError
from cadence.errors import CadenceValueError

__all__ = ["Replica", "wrapped_parameters"]

_AGAIN = "or wrap the model in a new DataParallel afterwards."
_FIX = " Fix: make such changes before wrapping the model, " + _AGAIN
_WHY = {
    "replaced": "replaced by other tensors after wrapping (load_state_dict(assign=True) or "
    "an assignment on dp.module?), so no hook of DataParallel sees their gradients",
    "frozen": "set to requires_grad=False after wrapping, but DataParallel reduces the "
    "parameters that required grad when it was built",
    "converted": "converted after wrapping (dp.module.to(...)?), but their gradient buckets "
    "hold the dtype and device they had then",
}


def _describe(found: list[tuple[str, str, str]]) -> str:
    """One sentence per kind of change, naming up to four parameters."""
    parts = []
    for kind, why in _WHY.items():
        names = [f"{name!r}{detail}" for k, name, detail in found if k == kind]
        if names:
            more = f" and {len(names) - 4} more" if len(names) > 4 else ""
            parts.append(f"Parameters {', '.join(names[:4])}{more} were {why}.")
    return " ".join(parts)


def wrapped_parameters(
    module: nn.Module,
    ignored: frozenset[str],
    reduce_dtype: torch.dtype | None,
    gradient_as_bucket_view: bool,
) -> list[tuple[str, nn.Parameter]]:
    """The parameters DataParallel reduces, refused here before any bucket or hook exists."""
    if reduce_dtype is not None and not reduce_dtype.is_floating_point:
        raise CadenceValueError(f"reduce_dtype must be a floating dtype, got {reduce_dtype}")
    # Not empty: resolve_ddp_args (run first) refused a module with none
    # (NothingToReduceError).
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored]
    if (
        gradient_as_bucket_view
        and reduce_dtype is not None
        and any(p.dtype != reduce_dtype for _, p in named)
    ):
        raise CadenceValueError(
            "gradient_as_bucket_view=True needs the wire dtype to equal the parameter dtype; "
            "drop reduce_dtype or set gradient_as_bucket_view=False"
        )
    for n, p in named:
        if p.is_sparse or p.layout != torch.strided:
            raise CadenceValueError(f"parameter '{n}' is not a dense strided tensor")
    return named


def sparse_gradient_indices(
    module: nn.Module, wrapped: list[tuple[str, nn.Parameter]]
) -> frozenset[int]:
    """Positions in ``wrapped`` of the parameters whose gradients come out sparse.

    torch DDP's rule: the weight of an ``nn.Embedding`` or ``nn.EmbeddingBag`` built
    with ``sparse=True``. See [Note: sparse buckets] in ``_buckets.py``.
    """
    ids = {
        id(m.weight)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    }
    return frozenset(i for i, (_, p) in enumerate(wrapped) if id(p) in ids)


class Replica:
    """The wrapped module's parameters and buffers, as DataParallel found them."""

    def __init__(
        self, module: nn.Module, wrapped: list[tuple[str, nn.Parameter]], ignored: set[str]
    ) -> None:
        wrapped_ids = {id(p) for _, p in wrapped}
        # (owner's parameter dict, attribute, object, dtype, device, name) per wrapped one.
        self._slots: list[
            tuple[dict[str, nn.Parameter | None], str, nn.Parameter, torch.dtype, torch.device, str]
        ] = []
        # (owner's parameter dict, attribute, name) per parameter frozen when wrapped.
        self._frozen: list[tuple[dict[str, nn.Parameter | None], str, str]] = []
        for name, p in module.named_parameters():
            if name in ignored:
                continue
            owner, _, attr = name.rpartition(".")
            params = module.get_submodule(owner)._parameters
            if id(p) in wrapped_ids:
                self._slots.append((params, attr, p, p.dtype, p.device, name))
            else:
                self._frozen.append((params, attr, name))
        self._buffer_slots: list[tuple[dict[str, torch.Tensor | None], str]] = []
        for name, _ in module.named_buffers():
            if name not in ignored:
                owner, _, attr = name.rpartition(".")
                self._buffer_slots.append((module.get_submodule(owner)._buffers, attr))

    def buffers(self) -> list[torch.Tensor]:
        """The buffers to broadcast, as they are now (conversions replace them)."""
        out = []
        for buffers, attr in self._buffer_slots:
            b = buffers.get(attr)
            if b is not None:
                out.append(b)
        return out

    def problems(self, names: set[str] | None = None) -> list[tuple[str, str, str]]:
        """(kind, name, detail) per wrapped parameter changed since wrapping (of ``names``)."""
        out = []
        for params, attr, p, dtype, device, name in self._slots:
            if names is not None and name not in names:
                continue
            if params.get(attr) is not p:
                out.append(("replaced", name, ""))
            elif not p.requires_grad:
                out.append(("frozen", name, ""))
            elif p.dtype != dtype or p.device != device:
                out.append(("converted", name, f" (now {p.dtype} on {p.device}, not {dtype})"))
        return out

    def explain(self, names: list[str]) -> str:
        """Why these parameters' gradients went wrong, with the fix; "" if unexplained."""
        found = self.problems(set(names))
        return _describe(found) + _FIX if found else ""

    def check(self, what: str) -> None:
        """Raise if any wrapped parameter was replaced, converted or frozen since wrapping."""
        found = self.problems()
        if found:
            raise DataParallelError(f"{what}: {_describe(found)}{_FIX}")

    def check_unfrozen(self, what: str) -> None:
        """Raise if a parameter frozen when wrapped requires grad now (per forward: cheap)."""
        for params, attr, name in self._frozen:
            q = params.get(attr)
            if q is not None and q.requires_grad:
                raise DataParallelError(
                    f"{what}: parameter {name!r} requires grad but did not when DataParallel "
                    "wrapped the model (requires_grad_(True) after wrapping?): its gradients "
                    "would never be all-reduced and the replicas would drift apart. Fix: "
                    "unfreeze parameters before wrapping, " + _AGAIN
                )

    def refuse_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor], what: str) -> None:
        """Refuse, before anything changes, an ``_apply`` that changes dtype or device."""
        for dtype, device in {(slot[3], slot[4]) for slot in self._slots}:
            target = conversion_target(fn, dtype, device)
            if target is not None and target != (dtype, device):
                raise DataParallelError(
                    f"{what} would turn the wrapped parameters from {dtype} on {device} into "
                    f"{target[0]} on {target[1]}, but DataParallel built its gradient buckets "
                    f"and hooks for {dtype} on {device}. Fix: convert the model before "
                    "wrapping it (DataParallel(model.to(...))), " + _AGAIN
                )
