"""`EmbeddingExchange`: a data-parallel embedding whose gradient crosses the wire as
the ids it looked up and the gradient of its output, not as rows of the table.

[Note: exchanging an embedding's gradient as its inputs]
An embedding's weight gradient is a function of two things only: the ids it looked
up (with a bag's offsets and per-sample weights) and the gradient of its output. It
is linear in the second, and nothing else of the model enters it. So the average of
every rank's gradient is the gradient of the whole world's batch: gather each rank's
ids and output gradient, divide the output gradients by the world, run the lookup's
own backward on the concatenation. torch's DDP (and the plain loop) all-reduces the
weight gradient instead; for a sparse table gloo gathers every rank's rows, one row
of ``dim`` values per id looked up. For an ``EmbeddingBag`` with bags of ``L`` ids
the output gradient has one row per bag, so the exchange moves about ``L`` times
fewer values (plus the ids, 4 bytes each where the table has fewer than 2**31 rows);
for a dense table an all-reduce moves the whole table, the exchange still only the
lookups.

The gradient of the concatenation is torch's: for a sparse table built from the
lookups with the operations of torch's backward, to its bits (see [Note: a sparse
table's gradient from its lookups] in ``_lookup_grad.py``), for a dense one by torch's
own backward (``F.embedding_bag`` / ``F.embedding`` on a view of the weight). So
``padding_idx``, a mean's bag sizes and ``per_sample_weights`` keep torch's
semantics; only the order of the float sums can differ from the all-reduced one.
Each rank builds that gradient for the world's batch: a row per id, cheap beside the
wire, but W times the local one. The gathered
bytes grow with the world as gloo's sparse all-reduce's do; where the world's ids
approach the table's rows, a dense all-reduce of the table is the smaller exchange.

Timing. Ranks may look up different numbers of ids, and gloo's all-gather needs one
size: each forward launches a gather of its sizes and whether it has per-sample
weights (24 bytes), waited at backward, long landed by then. The packing follows from
what every rank sent, so the ranks agree on it: the offsets' width from the largest
count, and a rank with weights where another has none is refused on every rank.
Backward launches the one gather of the packed ids, offsets, weights and output
gradient (`_Packing`) as soon as the output's gradient exists, which for the usual
model, the embedding first, is the end of backward. The caller
decides where it is waited (`finalize`), as with `DataParallel.finalize_backward`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from cadence.comm import Comm, CommWork, ReductionHandle
from cadence.data_parallel._errors import DataParallelError
from cadence.data_parallel._lookup_grad import lookup_grad
from cadence.errors import CadenceValueError

__all__ = ["EmbeddingExchange"]

_ALIGN = 8  # every packed section starts at a multiple of the widest element


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclasses.dataclass
class _Call:
    """One forward of the embedding in this step, and its exchange once backward ran."""

    ids: torch.Tensor  # 1-D
    offsets: torch.Tensor | None  # 1-D bag starts (no last offset); None: an Embedding
    weights: torch.Tensor | None  # per_sample_weights, 1-D, or None
    sizes: torch.Tensor  # world x 3: every rank's (ids, rows of its gradient, has weights)
    sizes_work: CommWork | None
    packing: _Packing | None = None
    gathered: torch.Tensor | None = None
    work: CommWork | None = None
    local_grad: torch.Tensor | None = None  # world 1: the output gradient itself


@dataclasses.dataclass(frozen=True)
class _Packing:
    """Byte layout of one rank's part of the gather: ids, offsets, weights, gradient."""

    id_dtype: torch.dtype
    off_dtype: torch.dtype
    grad_dtype: torch.dtype
    dim: int
    has_offsets: bool
    has_weights: bool

    def spans(self, n_ids: int, n_rows: int) -> list[tuple[int, int]]:
        """(start, nbytes) of each section for a rank with these sizes."""
        sections = [
            n_ids * self.id_dtype.itemsize,
            n_rows * self.off_dtype.itemsize if self.has_offsets else 0,
            n_ids * self.grad_dtype.itemsize if self.has_weights else 0,
            n_rows * self.dim * self.grad_dtype.itemsize,
        ]
        spans, at = [], 0
        for n in sections:
            spans.append((at, n))
            at += _aligned(n)
        return spans

    def size(self, n_ids: int, n_rows: int) -> int:
        start, n = self.spans(n_ids, n_rows)[-1]
        return start + _aligned(n)

    def pack(self, call: _Call, grad: torch.Tensor, into: torch.Tensor) -> None:
        parts = [
            call.ids.to(self.id_dtype),
            None if call.offsets is None else call.offsets.to(self.off_dtype),
            None if call.weights is None else call.weights.to(self.grad_dtype),
            grad,
        ]
        n_ids, n_rows = call.ids.numel(), grad.shape[0]
        for (start, n), part in zip(self.spans(n_ids, n_rows), parts, strict=True):
            if part is not None and n:
                into[start : start + n].copy_(part.contiguous().reshape(-1).view(torch.uint8))

    def unpack(self, buf: torch.Tensor, n_ids: int, n_rows: int) -> list[torch.Tensor | None]:
        dtypes = (self.id_dtype, self.off_dtype, self.grad_dtype, self.grad_dtype)
        flags = (True, self.has_offsets, self.has_weights, True)
        out: list[torch.Tensor | None] = []
        for (start, n), dtype, present in zip(self.spans(n_ids, n_rows), dtypes, flags):
            out.append(buf[start : start + n].view(dtype) if present else None)
        grad = out[3]
        assert grad is not None
        out[3] = grad.view(n_rows, self.dim)
        return out


class _Capture(torch.autograd.Function):
    """Passes the lookup's output through; its backward hands the output's gradient
    to the exchange instead of writing the table's gradient locally."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, out: torch.Tensor, hook: Any) -> torch.Tensor:
        ctx.hook = hook
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.hook(grad)
        return None, None, None


class EmbeddingExchange:
    """Average an ``nn.Embedding``'s or ``nn.EmbeddingBag``'s gradient over a data-parallel
    group by exchanging the ids it looked up and its output's gradient: see [Note:
    exchanging an embedding's gradient as its inputs].

    The module stays the user's own (same parameters, same ``state_dict``); hooks do
    the rest. Each forward with grad enabled is recorded; its backward launches its
    exchange and writes no local gradient; `finalize` waits every exchange of the
    step and writes the averaged gradient into ``weight.grad`` (sparse where the
    module is ``sparse=True``, added to a gradient already there)::

        exchange = EmbeddingExchange(bag, comm)   # comm: the data-parallel Comm
        loss = tower(bag(ids, offsets)).mean()
        loss.backward()                           # launches the exchange
        handle = exchange.finalize(async_op=True)
        ...                                       # other work while it flies
        handle.wait()
        sparse_opt.step()

    Every rank must run the same number of forwards per step, and each forward's
    output must reach the loss (run the others under ``torch.no_grad()``). Refused,
    with the reason: ``max_norm`` (the forward renormalizes the table),
    ``scale_grad_by_freq`` (a rank's frequencies are not the world's), ``mode="max"``
    and per-sample weights that require grad.
    """

    def __init__(
        self,
        module: nn.Embedding | nn.EmbeddingBag,
        comm: Comm,
        *,
        op: Literal["avg", "sum"] = "avg",
    ) -> None:
        if not isinstance(module, nn.Embedding | nn.EmbeddingBag):
            raise CadenceValueError(
                f"EmbeddingExchange: got a {type(module).__name__}; pass an nn.Embedding "
                "or an nn.EmbeddingBag (wrap other modules with DataParallel)."
            )
        name = type(module).__name__
        if module.max_norm is not None:
            raise CadenceValueError(
                f"EmbeddingExchange: the {name} has max_norm={module.max_norm}, which "
                "rewrites the table's rows in every forward; set max_norm=None."
            )
        if module.scale_grad_by_freq:
            raise CadenceValueError(
                f"EmbeddingExchange: the {name} has scale_grad_by_freq=True, which scales "
                "by each rank's own frequencies; set scale_grad_by_freq=False."
            )
        if isinstance(module, nn.EmbeddingBag) and module.mode == "max":
            raise CadenceValueError(
                'EmbeddingExchange: mode="max" needs the argmax of every bag, not only '
                'its ids; use mode="sum" or "mean", or wrap the module with DataParallel.'
            )
        if not module.weight.requires_grad:
            raise CadenceValueError(
                f"EmbeddingExchange: the {name}'s weight does not require grad; there is "
                "nothing to exchange."
            )
        if op not in ("avg", "sum"):
            raise CadenceValueError(f'EmbeddingExchange: op must be "avg" or "sum", got {op!r}')
        self.module = module
        self.comm = comm
        self.op = op
        self._calls: list[_Call] = []
        num = module.num_embeddings
        self._id_dtype = torch.int32 if num < 2**31 else torch.int64
        self._hook = module.register_forward_hook(self._on_forward, with_kwargs=True)

    # -- recording ------------------------------------------------------------

    def _inputs(
        self, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The forward's ids as 1-D, its bag starts (no last offset), its weights."""
        names = ("input", "offsets", "per_sample_weights")
        given = dict(zip(names, args, strict=False)) | kwargs
        ids: torch.Tensor = given["input"]
        if isinstance(self.module, nn.Embedding):
            return ids.reshape(-1), None, None
        offsets, weights = given.get("offsets"), given.get("per_sample_weights")
        if weights is not None and weights.requires_grad:
            raise CadenceValueError(
                "EmbeddingExchange: per_sample_weights require grad, and their gradient "
                "would need the table's rows; detach them, or wrap the module with "
                "DataParallel."
            )
        if ids.dim() == 2:
            bags, length = ids.shape
            offsets = torch.arange(0, bags * length, length, device=ids.device)
        else:
            assert offsets is not None  # EmbeddingBag itself refuses 1-D input without them
            if self.module.include_last_offset:
                offsets = offsets[:-1]
        return ids.reshape(-1), offsets, None if weights is None else weights.reshape(-1)

    def _on_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        if not torch.is_grad_enabled():
            return None
        ids, offsets, weights = self._inputs(args, kwargs)
        rows = ids.numel() if offsets is None else offsets.numel()
        mine = torch.tensor(
            [ids.numel(), rows, int(weights is not None)], dtype=torch.int64, device=ids.device
        )
        sizes, work = mine.unsqueeze(0), None
        if self.comm.world_size > 1:
            flat = torch.empty(3 * self.comm.world_size, dtype=torch.int64, device=ids.device)
            work = self.comm.all_gather_single(flat, mine, async_op=True)
            sizes = flat.view(-1, 3)
        call = _Call(ids.detach(), offsets, weights, sizes, work)
        self._calls.append(call)
        return _Capture.apply(self.module.weight, output.detach(), lambda g: self._launch(call, g))

    def _launch(self, call: _Call, grad: torch.Tensor) -> None:
        if call.work is not None or call.local_grad is not None:
            raise DataParallelError(
                "EmbeddingExchange: a second backward through one forward's output; "
                "each forward's exchange carries one gradient. Run a forward per backward."
            )
        grad = grad.detach().reshape(-1, grad.shape[-1])
        if self.comm.world_size == 1:
            call.local_grad = grad
            return
        if call.sizes_work is not None:
            call.sizes_work.wait()
        # Every rank gathered the same sizes, so every rank refuses (or packs) alike.
        gathered_sizes = call.sizes.tolist()
        sizes = [(n, r) for n, r, _ in gathered_sizes]
        if any(n < 0 or r < 0 for n, r in sizes):
            raise DataParallelError(
                f"EmbeddingExchange: the ranks' lookup sizes {sizes} hold a negative count; "
                "a rank sent a corrupt size. Every rank refuses the same gather."
            )
        with_weights = {bool(w) for *_, w in gathered_sizes}
        if len(with_weights) > 1:
            raise DataParallelError(
                "EmbeddingExchange: some ranks passed per_sample_weights and some did not; "
                "pass them on every rank or on none."
            )
        packing = _Packing(
            id_dtype=self._id_dtype,
            off_dtype=torch.int32 if max(n for n, _ in sizes) < 2**31 else torch.int64,
            grad_dtype=grad.dtype,
            dim=grad.shape[-1],
            has_offsets=call.offsets is not None,
            has_weights=call.weights is not None,
        )
        width = max(packing.size(n, r) for n, r in sizes)
        mine = torch.zeros(width, dtype=torch.uint8, device=grad.device)
        packing.pack(call, grad, mine)
        gathered = torch.empty(self.comm.world_size * width, dtype=torch.uint8, device=grad.device)
        call.packing, call.gathered = packing, gathered
        call.work = self.comm.all_gather_single(gathered, mine, async_op=True)

    # -- finalization -----------------------------------------------------------

    @property
    def pending(self) -> int:
        """Forwards recorded since the last `finalize`."""
        return len(self._calls)

    def finalize(self, *, async_op: bool = False) -> ReductionHandle | None:
        """Wait this step's exchanges and write the averaged gradient into ``weight.grad``.

        Blocking, returns None; with ``async_op=True`` returns a `ReductionHandle`
        whose ``wait()`` writes it (already completed when no forward was recorded).
        Raised locally, before any wait: a recorded forward whose output got no
        gradient in backward.
        """
        calls, self._calls = self._calls, []
        missing = [i for i, c in enumerate(calls) if c.work is None and c.local_grad is None]
        if missing:
            self._calls = calls
            raise DataParallelError(
                f"EmbeddingExchange.finalize: forward call(s) {missing} of this step got no "
                "gradient: run backward first, and run a forward whose output does not "
                "reach the loss under torch.no_grad()."
            )
        if not calls:
            return ReductionHandle.completed("embedding exchange") if async_op else None
        works = [c.work for c in calls if c.work is not None]
        handle = ReductionHandle(
            works, on_complete=lambda: self._write(calls), label="embedding exchange"
        )
        if async_op:
            return handle
        handle.wait()
        return None

    def _write(self, calls: list[_Call]) -> None:
        # The average divides the output's gradient (a row per bag) before the lookup
        # backward, not the table's gradient after it (a row per id, bag-length times
        # more values): the backward is linear in it, and for a power-of-two world the
        # result is bitwise the same.
        divide = self.comm.world_size if self.op == "avg" and self.comm.world_size > 1 else 1
        total: torch.Tensor | None = None
        for call in calls:
            grad = self._world_grad(call, divide)
            total = grad if total is None else total + grad
        if total is None:
            return
        weight = self.module.weight
        weight.grad = total if weight.grad is None else weight.grad + total

    def _world_grad(self, call: _Call, divide: int) -> torch.Tensor:
        """The table's gradient for every rank's lookups of this call: built from the
        lookups for a sparse table (see [Note: a sparse table's gradient from its
        lookups] in ``_lookup_grad.py``), by torch's own backward on their
        concatenation for a dense one."""
        if call.local_grad is not None:
            ids, offsets, weights, grad = call.ids, call.offsets, call.weights, call.local_grad
        else:
            ids, offsets, weights, grad = self._concatenated(call)
        module = self.module
        # The output's gradient arrives in the dtype the model's backward gave it; the
        # lookup's output has the table's.
        out_grad = grad.to(module.weight.dtype)
        if divide > 1:
            out_grad = out_grad / divide
        if module.sparse:
            return lookup_grad(module, ids, offsets, weights, out_grad)
        leaf = module.weight.detach().requires_grad_(True)
        with torch.enable_grad():
            if isinstance(module, nn.Embedding):
                out = F.embedding(ids, leaf, module.padding_idx)
            else:
                out = F.embedding_bag(
                    ids,
                    leaf,
                    offsets,
                    mode=module.mode,
                    per_sample_weights=weights,
                    padding_idx=module.padding_idx,
                )
            (result,) = torch.autograd.grad(out, leaf, out_grad)
        return result

    def _concatenated(
        self, call: _Call
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        packing, gathered = call.packing, call.gathered
        assert packing is not None and gathered is not None
        sizes = [(n, r) for n, r, _ in call.sizes.tolist()]
        width = gathered.numel() // len(sizes)
        ids, offsets, weights, grads = [], [], [], []
        base = 0
        for r, (n_ids, n_rows) in enumerate(sizes):
            part = packing.unpack(gathered[r * width : (r + 1) * width], n_ids, n_rows)
            rank_ids, rank_offsets, rank_weights, rank_grad = part
            assert rank_ids is not None and rank_grad is not None
            self._check_lookups(r, rank_ids, rank_offsets, n_ids)
            ids.append(rank_ids.long())
            if rank_offsets is not None:
                offsets.append(rank_offsets.long() + base)
            if rank_weights is not None:
                weights.append(rank_weights)
            grads.append(rank_grad)
            base += n_ids
        return (
            torch.cat(ids),
            torch.cat(offsets) if offsets else None,
            torch.cat(weights) if weights else None,
            torch.cat(grads),
        )

    def _check_lookups(
        self, rank: int, ids: torch.Tensor, offsets: torch.Tensor | None, n_ids: int
    ) -> None:
        """Refuse a peer's lookups that the kernel would read out of bounds with. Every
        rank holds the same gathered bytes, so every rank refuses the same rank's."""
        num = self.module.num_embeddings
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num):
            raise DataParallelError(
                f"EmbeddingExchange: rank {rank} sent ids outside [0, {num}); its lookups "
                "or its bytes are corrupt. Check that every rank builds the same table."
            )
        if offsets is None or not offsets.numel():
            return
        starts = offsets.long()
        if int(starts[0]) != 0 or int(starts[-1]) > n_ids or bool((starts.diff() < 0).any()):
            raise DataParallelError(
                f"EmbeddingExchange: rank {rank} sent bag offsets that do not start at 0 and "
                f"rise within its {n_ids} ids; its bytes are corrupt."
            )

    def remove(self) -> None:
        """Detach from the module: later forwards are plain lookups again."""
        self._hook.remove()
