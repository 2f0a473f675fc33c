"""Overlap pattern (a): sparse work while the dense gradient all-reduce is in flight.

Run:  python examples/overlap_sparse.py [--steps 5] [--exchange rows|lookups]

A DLRM-shaped toy model: an ``nn.EmbeddingBag(sparse=True)`` (outside the
wrapper, with its own SGD and its own exchange, so that this work can run while the
dense reduction flies; inside the wrapper it would get a sparse bucket) feeds a
dense MLP wrapped in `cadence.DataParallel` with manual finalization.

With torch DDP the end of ``loss.backward()`` blocks until every dense
all-reduce has finished and been copied back, and only then can the sparse
half (its gradient exchange and optimizer step) run. Here backward only
*launches* the dense all-reduces; the sparse half runs while they are in flight,
and ``dp.finalize_backward()`` waits for them afterwards:

    compute: [dense bwd][sparse bwd][sparse exchange + sparse step][finalize][dense step]
    comm:        [AR b0][AR b1 ... AR bn ..........................]

The event log records ``sparse_start`` / ``sparse_end`` marks on the same clock
as the collectives, which is how the test proves the order.

The embedding's gradient is averaged over the ranks in one of two ways:
``--exchange rows`` all-reduces its sparse gradient, as torch DDP would;
``--exchange lookups`` uses `cadence.data_parallel.EmbeddingExchange`, which
gathers each rank's ids and the gradient of the bag's output (one row per bag
instead of one per id) and launches that gather in backward. Both give the same
gradient.

This module also holds the model and data shared by
``examples/optimizer_in_backward.py`` and the tests.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cadence
from cadence.data_parallel import EmbeddingExchange

VOCAB = 64
EMB_DIM = 8
DENSE_IN = 8
HIDDEN = 32
DEPTH = 4
BAG_LEN = 3
PER_RANK = 4


def build_models(seed: int = 0) -> tuple[nn.EmbeddingBag, nn.Sequential]:
    """The sparse embedding and the dense MLP (identical on every rank for a given seed)."""
    torch.manual_seed(seed)
    bag = nn.EmbeddingBag(VOCAB, EMB_DIM, mode="mean", sparse=True)
    layers: list[nn.Module] = [nn.Linear(EMB_DIM + DENSE_IN, HIDDEN), nn.ReLU()]
    for _ in range(DEPTH - 1):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
    layers.append(nn.Linear(HIDDEN, 1))
    return bag, nn.Sequential(*layers)


def global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [N, BAG_LEN], dense features [N, DENSE_IN], targets [N, 1]) for N = world * PER_RANK."""
    g = torch.Generator().manual_seed(1000 + step)
    n = world * PER_RANK
    ids = torch.randint(0, VOCAB, (n, BAG_LEN), generator=g)
    x = torch.randn(n, DENSE_IN, generator=g)
    y = torch.randn(n, 1, generator=g)
    return ids, x, y


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def forward(
    bag: nn.EmbeddingBag,
    dense: nn.Module,
    ids: torch.Tensor,
    x: torch.Tensor,
    emb_hook: Callable[[torch.Tensor], Any] | None = None,
) -> torch.Tensor:
    """Embedding lookup, then the dense tower on [tanh(embedding), dense features].

    ``emb_hook`` is registered on the raw embedding output: a tensor on the
    sparse path, upstream of the dense module. Its gradient is ready only after
    the dense tower's whole backward (every wrapped AccumulateGrad has run),
    which is where pattern (b) finalizes.
    """
    emb = bag(ids)
    if emb_hook is not None:
        emb.register_hook(emb_hook)
    return dense(torch.cat([torch.tanh(emb), x], dim=1))


def average_sparse_grad(comm: cadence.Comm, bag: nn.EmbeddingBag) -> None:
    """Average the embedding's sparse gradient over ranks (gloo supports sparse all-reduce).

    It runs on its own process group, so it does not queue behind the dense
    buckets still in flight on the DataParallel group.
    """
    grad = bag.weight.grad
    assert grad is not None and grad.is_sparse
    comm.all_reduce(grad, op="avg")


class Trainer:
    """Per-rank state: wrapped dense tower, sparse embedding, their optimizers, one log."""

    def __init__(self, seed: int = 0, lr: float = 0.05, exchange: str = "rows") -> None:
        if exchange not in ("rows", "lookups"):
            raise ValueError(f'exchange must be "rows" or "lookups", got {exchange!r}')
        self.log = cadence.EventLog()
        bag, mlp = build_models(seed)
        self.bag = bag
        self.dp = cadence.DataParallel(
            mlp, bucket_cap_mb=0.001, first_bucket_cap_mb=None, event_log=self.log
        )
        self.dp.require_manual_backward_finalization = True
        self.dense_opt = torch.optim.SGD(self.dp.parameters(), lr=lr)
        self.dp.register_optimizer(self.dense_opt)  # step() before finalize would raise
        self.sparse_opt = torch.optim.SGD(self.bag.parameters(), lr=lr)
        # A second gloo group: the sparse exchange must not wait behind the dense buckets.
        self.sparse_comm = cadence.Comm(
            dist.new_group(backend="gloo"), event_log=self.log, name="sparse"
        )
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # "lookups": the bag's gradient crosses as its ids and output gradient,
        # launched in backward; finalize() waits it and writes bag.weight.grad.
        self.exchange = (
            EmbeddingExchange(self.bag, self.sparse_comm) if exchange == "lookups" else None
        )

    def local_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, x, y = global_batch(step, self.world)
        return (
            shard(ids, self.rank, self.world),
            shard(x, self.rank, self.world),
            shard(y, self.rank, self.world),
        )

    def step_overlapped(self, step: int) -> float:
        """One pattern-(a) step; returns the local loss.

        SGD leaves ``.grad`` as it is, so the averaged gradients can still be read
        after the step (the tests compare them with the reference).
        """
        ids, x, y = self.local_batch(step)
        self.dense_opt.zero_grad(set_to_none=True)
        self.sparse_opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(forward(self.bag, self.dp, ids, x), y)
        loss.backward()  # launches every dense bucket, waits for none (manual mode)
        self.log.mark("sparse_start", step=step)
        if self.exchange is not None:
            self.exchange.finalize()
        else:
            average_sparse_grad(self.sparse_comm, self.bag)
        self.sparse_opt.step()
        self.log.mark("sparse_end", step=step)
        self.dp.finalize_backward()  # now wait the dense all-reduces and write .grad
        self.dense_opt.step()
        return loss.item()


def reference_step(
    bag: nn.EmbeddingBag,
    mlp: nn.Module,
    opts: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    step: int,
    world: int,
) -> None:
    """Single-process training on the concatenated global batch (the parity oracle)."""
    ids, x, y = global_batch(step, world)
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    F.mse_loss(forward(bag, mlp, ids, x), y).backward()
    for opt in opts:
        opt.step()


def rank_main(steps: int, exchange: str = "rows") -> dict[str, Any]:
    trainer = Trainer(exchange=exchange)
    losses = [trainer.step_overlapped(step) for step in range(steps)]
    marks = {m.group: m for m in trainer.log.marks() if m.meta.get("step") == steps - 1}
    last = trainer.log.collectives("all_reduce", group="dp")[-trainer.dp.num_buckets :]
    stats = trainer.dp.stats()
    return {
        "losses": losses,
        "buckets": trainer.dp.num_buckets,
        "issued_before_sparse": sum(e.issue_t < marks["sparse_start"].issue_t for e in last),
        "waited_after_sparse": sum(
            e.wait_end_t is not None and e.wait_end_t > marks["sparse_end"].issue_t for e in last
        ),
        "hidden_fraction": stats["overlapped_s"]
        / max(stats["overlapped_s"] + stats["exposed_s"], 1e-12),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--exchange", choices=("rows", "lookups"), default="rows")
    args = parser.parse_args()
    results = cadence.launch(
        rank_main, args.steps, args.exchange, nprocs=2, backend="gloo", num_threads=1
    )
    r = results[0]
    n = r["buckets"]
    print(
        f"pattern (a): {n} dense buckets, {args.steps} steps on 2 gloo ranks, "
        f"the embedding's gradient exchanged as its {args.exchange}"
    )
    print(f"  loss (rank 0): {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
    print(
        f"  last step: {r['issued_before_sparse']}/{n} dense all-reduces issued before "
        f"sparse_start, {r['waited_after_sparse']}/{n} waited after sparse_end"
    )
    print(f"  dense communication in flight (not blocked on): {r['hidden_fraction']:.0%}")


def reference_models(
    seed: int = 0, lr: float = 0.05
) -> tuple[nn.EmbeddingBag, nn.Sequential, tuple[torch.optim.Optimizer, torch.optim.Optimizer]]:
    """The single-process oracle: the same models and optimizers, no wrapper."""
    bag, mlp = build_models(seed)
    opts = (torch.optim.SGD(bag.parameters(), lr=lr), torch.optim.SGD(mlp.parameters(), lr=lr))
    return bag, mlp, opts


if __name__ == "__main__":
    main()
