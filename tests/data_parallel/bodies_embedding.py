"""Scenarios for `EmbeddingExchange`; the world-2 launch and a world-1 one run `SCENARIOS`.

Parity: every rank builds every rank's inputs from its seed, so each can compute the
single-process gradient of the concatenated batch (the mean of the ranks' losses)
beside the exchanged one. torch's DDP on the same embedding is the other reference.
Counts and order come from the `EventLog`; misuse is refused with the cause named.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cadence.comm import Comm, EventLog
from cadence.data_parallel import DataParallelError, EmbeddingExchange
from cadence.data_parallel._embedding_exchange import _Call, _Packing
from tests._scenarios import Scenario, assert_raises, scenarios

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
VOCAB, DIM = 40, 6


def _comm(log: EventLog | None = None) -> Comm:
    return Comm(dist.group.WORLD, name="embedding", event_log=log)


def _module(kind: str, **kw: Any) -> nn.Embedding | nn.EmbeddingBag:
    torch.manual_seed(0)
    if kind == "embedding":
        return nn.Embedding(VOCAB, DIM, **kw)
    return nn.EmbeddingBag(VOCAB, DIM, **kw)


def _inputs(config: str, rank: int, step: int) -> Inputs:
    """Rank ``rank``'s forward arguments at ``step``; sizes differ between ranks."""
    g = torch.Generator().manual_seed(100 * step + rank)
    bags = 3 + rank  # ranks look up different numbers of ids
    if config == "2d":
        ids = torch.randint(0, VOCAB, (bags, 4), generator=g)
        ids[0, 0] = 1  # padding_idx where a config sets it
        return (ids,), {}
    if config == "embedding":
        ids = torch.randint(0, VOCAB, (bags, 5), generator=g)
        ids[0, 0] = 1
        return (ids,), {}
    lengths = torch.randint(1, 6, (bags,), generator=g)
    lengths[-1] = 0  # an empty bag
    ids = torch.randint(0, VOCAB, (int(lengths.sum()),), generator=g)
    ids[0] = 1
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    if config == "offsets_last":
        return (ids, torch.cat([offsets, lengths.sum().reshape(1)])), {}
    if config == "weights":
        return (ids,), {
            "offsets": offsets,
            "per_sample_weights": torch.rand(ids.numel(), generator=g),
        }
    return (ids, offsets), {}


def _loss(out: torch.Tensor, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return (out * torch.randn(out.shape, generator=g)).sum() + out.pow(2).mean()


# (module kind, its options, the input configuration)
CONFIGS: dict[str, tuple[str, dict[str, Any], str]] = {
    "bag-mean-sparse-2d": ("bag", {"mode": "mean", "sparse": True}, "2d"),
    "bag-sum-dense-2d-padding": ("bag", {"mode": "sum", "padding_idx": 1}, "2d"),
    "bag-mean-sparse-offsets-padding": (
        "bag", {"mode": "mean", "sparse": True, "padding_idx": 1}, "offsets"),
    "bag-mean-dense-last-offset": (
        "bag", {"mode": "mean", "include_last_offset": True}, "offsets_last"),
    "bag-sum-sparse-weights": ("bag", {"mode": "sum", "sparse": True}, "weights"),
    "embedding-sparse-padding": ("embedding", {"sparse": True, "padding_idx": 1}, "embedding"),
    "embedding-dense": ("embedding", {}, "embedding"),
}  # fmt: skip


def _dense(grad: torch.Tensor | None) -> torch.Tensor:
    assert grad is not None
    return grad.to_dense() if grad.is_sparse else grad


def matches_one_process_on_the_world_batch(config: str) -> None:
    """Three SGD steps; each step's gradient and the weights after it equal those of one
    process on every rank's lookups (the mean of the ranks' losses)."""
    kind, options, inputs = CONFIGS[config]
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, ref = _module(kind, **options), _module(kind, **options)
    if kind == "bag" and options.get("include_last_offset"):
        assert mine.include_last_offset
    exchange = EmbeddingExchange(mine, _comm())
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (mine, ref))
    for step in range(3):
        args, kwargs = _inputs(inputs, rank, step)
        _loss(mine(*args, **kwargs), rank).backward()
        assert mine.weight.grad is None, "backward wrote the local gradient"
        exchange.finalize()
        total = sum(
            _loss(ref(*a, **k), r) for r in range(world) for a, k in [_inputs(inputs, r, step)]
        )
        assert isinstance(total, torch.Tensor)
        (total / world).backward()
        assert mine.weight.grad is not None
        assert mine.weight.grad.is_sparse == bool(options.get("sparse")), mine.weight.grad
        torch.testing.assert_close(_dense(mine.weight.grad), _dense(ref.weight.grad))
        if options.get("padding_idx") is not None:
            assert not _dense(mine.weight.grad)[1].any(), "padding row got a gradient"
        opt.step(), ref_opt.step()
        opt.zero_grad(set_to_none=True), ref_opt.zero_grad(set_to_none=True)
    torch.testing.assert_close(mine.weight, ref.weight)


def matches_torch_ddp() -> None:
    """A sparse bag under torch's DDP (gloo's sparse all-reduce) and under the exchange:
    equal weights after three SGD steps."""
    rank = dist.get_rank()
    bag = _module("bag", mode="mean", sparse=True)
    ddp = DDP(copy.deepcopy(bag))
    exchange = EmbeddingExchange(bag, _comm())
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (bag, ddp)]
    for step in range(3):
        args, kwargs = _inputs("offsets", rank, step)
        _loss(bag(*args, **kwargs), rank).backward()
        exchange.finalize()
        _loss(ddp(*args, **kwargs), rank).backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    torch.testing.assert_close(bag.weight, ddp.module.weight)


def moves_its_inputs_not_its_rows() -> None:
    """Per forward: one gather of the sizes at forward, one of the packed lookups
    issued in backward and waited in finalize; for bags of 16 ids, under a tenth of
    the bytes of the sparse gradient's rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    log = EventLog()
    torch.manual_seed(0)
    dim = 64  # the ids' own bytes weigh little beside a row of this width
    bag = nn.EmbeddingBag(VOCAB, dim, mode="mean", sparse=True)
    exchange = EmbeddingExchange(bag, _comm(log))
    ids = torch.randint(0, VOCAB, (32, 16), generator=torch.Generator().manual_seed(rank))
    out = bag(ids)
    kinds = [e.kind for e in log.events]
    assert kinds == (["all_gather"] if world > 1 else []), kinds
    _loss(out, rank).backward()
    log.mark("backward returned")
    assert exchange.pending == 1
    exchange.finalize()
    assert exchange.pending == 0
    if world == 1:
        assert log.count() == 0, "world 1 issued a collective"
        return
    sizes, payload = [e for e in log.events if e.kind == "all_gather"]
    mark = next(e for e in log.events if e.kind == "mark")
    assert sizes.nbytes == 24 * world, sizes
    assert payload.issue_t < mark.issue_t <= payload.wait_start_t, (payload, mark)  # type: ignore[operator]
    rows_bytes = world * ids.numel() * dim * 4  # the sparse gradient's values, every rank's
    assert payload.nbytes < rows_bytes / 10, (payload.nbytes, rows_bytes)


def async_handle_writes_on_wait() -> None:
    rank = dist.get_rank()
    bag = _module("bag", mode="sum", sparse=True)
    exchange = EmbeddingExchange(bag, _comm())
    args, kwargs = _inputs("offsets", rank, 0)
    _loss(bag(*args, **kwargs), rank).backward()
    handle = exchange.finalize(async_op=True)
    assert handle is not None and not handle.done
    assert bag.weight.grad is None, "the gradient was written before wait()"
    handle.wait()
    assert handle.done and bag.weight.grad is not None
    # Nothing recorded since: a completed handle, no collective.
    empty = exchange.finalize(async_op=True)
    assert empty is not None and empty.done and empty.num_works == 0


def accumulates_micro_batches_and_existing_grads() -> None:
    """Two forwards and backwards, then one finalize: the sum of both steps' world
    gradients, added to a gradient already in ``.grad``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, ref = _module("bag", mode="mean"), _module("bag", mode="mean")
    exchange = EmbeddingExchange(mine, _comm())
    seed = torch.full_like(mine.weight, 0.25)
    mine.weight.grad, ref.weight.grad = seed.clone(), seed.clone()
    for step in range(2):
        args, kwargs = _inputs("2d", rank, step)
        _loss(mine(*args, **kwargs), rank).backward()
        total = sum(
            _loss(ref(*a, **k), r) for r in range(world) for a, k in [_inputs("2d", r, step)]
        )
        assert isinstance(total, torch.Tensor)
        (total / world).backward()
    assert exchange.pending == 2
    exchange.finalize()
    torch.testing.assert_close(mine.weight.grad, ref.weight.grad)


def op_sum_adds_instead_of_averaging() -> None:
    """``op="sum"``: the ranks' gradients added, the world times the average."""
    rank, world = dist.get_rank(), dist.get_world_size()
    summed, averaged = _module("bag", mode="mean"), _module("bag", mode="mean")
    exchanges = [EmbeddingExchange(summed, _comm(), op="sum"), EmbeddingExchange(averaged, _comm())]
    args, kwargs = _inputs("offsets", rank, 0)
    for m, exchange in zip((summed, averaged), exchanges, strict=True):
        _loss(m(*args, **kwargs), rank).backward()
        exchange.finalize()
    assert summed.weight.grad is not None and averaged.weight.grad is not None
    torch.testing.assert_close(summed.weight.grad, world * averaged.weight.grad)


def no_grad_forwards_are_not_recorded() -> None:
    bag = _module("bag", mode="mean")
    exchange = EmbeddingExchange(bag, _comm())
    with torch.no_grad():
        bag(torch.zeros(2, 3, dtype=torch.long))
    assert exchange.pending == 0
    exchange.remove()
    bag(torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    assert exchange.pending == 0 and bag.weight.grad is not None, "remove() left the hook"


def refuses_what_it_cannot_exchange() -> None:
    comm = _comm()
    assert_raises(lambda: EmbeddingExchange(nn.Linear(2, 2), comm), "nn.EmbeddingBag")  # type: ignore[arg-type]
    assert_raises(lambda: EmbeddingExchange(_module("bag", max_norm=1.0), comm), "max_norm=None")
    assert_raises(
        lambda: EmbeddingExchange(_module("embedding", scale_grad_by_freq=True), comm),
        "scale_grad_by_freq=False",
    )
    assert_raises(lambda: EmbeddingExchange(_module("bag", mode="max"), comm), 'mode="sum"')
    frozen = _module("bag")
    frozen.weight.requires_grad_(False)
    assert_raises(lambda: EmbeddingExchange(frozen, comm), "does not require grad")
    assert_raises(lambda: EmbeddingExchange(_module("bag"), comm, op="max"), 'op must be "avg"')  # type: ignore[arg-type]
    bag = _module("bag", mode="sum")
    EmbeddingExchange(bag, comm)
    ids = torch.zeros(3, dtype=torch.long)
    weights = torch.ones(3, requires_grad=True)
    assert_raises(lambda: bag(ids, torch.tensor([0]), per_sample_weights=weights), "detach them")


def finalize_before_backward_raises_locally() -> None:
    """A forward whose output got no gradient: finalize names it and issues nothing."""
    rank = dist.get_rank()
    log = EventLog()
    bag = _module("bag", mode="mean")
    exchange = EmbeddingExchange(bag, _comm(log))
    out = bag(torch.zeros(2, 3, dtype=torch.long))
    before = len(log.events)
    assert_raises(
        exchange.finalize, "forward call(s) [0]", "torch.no_grad()", kind=DataParallelError
    )
    assert len(log.events) == before, "finalize issued a collective before refusing"
    _loss(out, rank).backward()  # the recorded forward is still there; it can finish
    exchange.finalize()
    assert bag.weight.grad is not None


def second_backward_through_one_forward_raises() -> None:
    rank = dist.get_rank()
    bag = _module("bag", mode="mean")
    exchange = EmbeddingExchange(bag, _comm())
    out = bag(torch.zeros(2, 3, dtype=torch.long))
    _loss(out, rank).backward(retain_graph=True)
    assert_raises(lambda: _loss(out, rank).backward(), "second backward", kind=DataParallelError)
    exchange.finalize()


def _gathered(bad: str) -> tuple[EmbeddingExchange, _Call]:
    """An exchange and a call whose gathered bytes hold rank 0's valid lookups and rank
    1's corrupted as ``bad`` says, as if a peer had sent them."""
    bag = _module("bag", mode="sum")
    exchange = EmbeddingExchange(bag, _comm())
    packing = _Packing(id_dtype=torch.int32, off_dtype=torch.int32, grad_dtype=torch.float32,
                       dim=DIM, has_offsets=True, has_weights=False)  # fmt: skip
    ids = torch.tensor([1, 2, 3, 4])
    offsets = torch.tensor([0, 2])
    width = packing.size(4, 2)
    gathered = torch.zeros(2 * width, dtype=torch.uint8)
    good = _Call(ids, offsets, None, torch.zeros(2, 3, dtype=torch.long), None)
    packing.pack(good, torch.ones(2, DIM), gathered[:width])
    theirs = _Call(
        torch.tensor([1, VOCAB, 3, 4]) if bad == "ids" else ids,
        torch.tensor([0, 5]) if bad == "offsets" else offsets,
        None, torch.zeros(2, 3, dtype=torch.long), None,
    )  # fmt: skip
    packing.pack(theirs, torch.ones(2, DIM), gathered[width:])
    call = _Call(ids, offsets, None, torch.tensor([[4, 2, 0], [4, 2, 0]]), None)
    call.packing, call.gathered = packing, gathered
    return exchange, call


def refuses_a_peers_corrupt_lookups() -> None:
    """Gathered bytes the kernel would read out of bounds with are refused, naming the
    rank that sent them; sizes with a negative count, or ranks that disagree on
    per-sample weights, are refused before any gather."""
    for bad, fragment in (("ids", f"outside [0, {VOCAB})"), ("offsets", "bag offsets")):
        exchange, call = _gathered(bad)
        assert_raises(
            lambda e=exchange, c=call: e._world_grad(c, 1),  # type: ignore[misc]
            "rank 1",
            fragment,
            kind=DataParallelError,
        )
    exchange, call = _gathered("none")
    assert exchange._world_grad(call, 1).is_sparse is False  # the same bytes, uncorrupted
    if dist.get_world_size() > 1:
        log = EventLog()
        exchange = EmbeddingExchange(_module("bag", mode="sum"), _comm(log))
        negative = _Call(torch.tensor([1]), torch.tensor([0]), None,
                         torch.tensor([[1, 1, 0], [-3, 1, 0]]), None)  # fmt: skip
        assert_raises(
            lambda: exchange._launch(negative, torch.ones(1, DIM)),
            "negative count",
            kind=DataParallelError,
        )
        mixed = _Call(torch.tensor([1]), torch.tensor([0]), None,
                      torch.tensor([[1, 1, 0], [1, 1, 1]]), None)  # fmt: skip
        assert_raises(
            lambda: exchange._launch(mixed, torch.ones(1, DIM)),
            "on every rank or on none",
            kind=DataParallelError,
        )
        assert log.count() == 0, "a gather was issued for corrupt sizes"


def _each_config() -> list[Scenario]:
    fn: Callable[..., None] = matches_one_process_on_the_world_batch
    return [Scenario(f"{fn.__name__}-{c}", fn, {"config": c}) for c in CONFIGS]


SCENARIOS = [
    *_each_config(),
    *scenarios(
        matches_torch_ddp,
        moves_its_inputs_not_its_rows,
        async_handle_writes_on_wait,
        accumulates_micro_batches_and_existing_grads,
        op_sum_adds_instead_of_averaging,
        no_grad_forwards_are_not_recorded,
        refuses_what_it_cannot_exchange,
        finalize_before_backward_raises_locally,
        second_backward_through_one_forward_raises,
        refuses_a_peers_corrupt_lookups,
    ),
]
