"""A single-file GPT training script, written the way popular public ones are.

Gradient accumulation by toggling ``model.require_backward_grad_sync``, gradient
clipping, AdamW with weight decay on the matrices only, a cosine learning rate and
checkpoint saving. Only the wrapping line depends on ``--wrapper``; the training loop
is the same for all four:

    torchrun --nproc_per_node 2 examples/train_gpt.py --wrapper ddp
    torchrun --nproc_per_node 2 examples/train_gpt.py --wrapper cadence-dp
    torchrun --nproc_per_node 2 examples/train_gpt.py --wrapper cadence-fsdp
    torchrun --nproc_per_node 2 examples/train_gpt.py --wrapper fsdp2

(``fsdp2`` is torch's own ``fully_shard``, which has no ``require_backward_grad_sync``:
the loop calls its ``set_requires_gradient_sync`` instead.) ``--count-collectives``
prints the gradient collectives issued per optimizer step, counted for cadence by its
``EventLog``, for torch DDP by a comm hook that wraps torch's own all-reduce hook, and
for FSDP2 by wrapping ``torch.distributed``'s collectives.
"""

from __future__ import annotations

import argparse
import math
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WRAPPERS = ("ddp", "cadence-dp", "cadence-fsdp", "fsdp2")


# -----------------------------------------------------------------------------
# the model: a small GPT (pre-norm blocks, tied embedding and output head)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, sequence length, embedding dim
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_embd: int, n_head: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        for m in self.modules():  # GPT-2's init: small normal weights, zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


# -----------------------------------------------------------------------------
# the one line that differs: wrapping


def wrap(model: GPT, wrapper: str, count: bool) -> tuple[nn.Module, Callable[[], Counter]]:
    """Wrap ``model``; return it and a function giving the collectives counted so far."""
    counts: Counter = Counter()
    if wrapper == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        if count:

            def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # torch checks
                counts["all_reduce"] += 1
                return default_hooks.allreduce_hook(None, bucket)

            ddp.register_comm_hook(None, counting_hook)
        return ddp, lambda: counts
    if wrapper == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, lambda: counts
    import cadence

    log = cadence.EventLog() if count else None
    if wrapper == "cadence-dp":
        wrapped: nn.Module = cadence.DataParallel(model, event_log=log)
    else:
        for block in model.h:
            cadence.fully_shard(block, event_log=log)
        wrapped = cadence.fully_shard(model, event_log=log)
    return wrapped, lambda: Counter(log.counts()) if log is not None else counts


@contextmanager
def counting_torch_collectives(counts: Counter, enabled: bool) -> Iterator[None]:
    """FSDP2 calls these ``torch.distributed`` functions by name: wrap them to count."""
    names = {
        "all_gather_single": "all_gather",  # torch >= 2.13 spelling
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
    }
    names = {n: k for n, k in names.items() if hasattr(dist, n)}
    saved = {name: getattr(dist, name) for name in names} if enabled else {}
    for name, kind in names.items() if enabled else ():

        def counted(*args: Any, _orig: Any = saved[name], _kind: str = kind, **kw: Any) -> Any:
            counts[_kind] += 1
            return _orig(*args, **kw)

        setattr(dist, name, counted)
    try:
        yield
    finally:
        for name, orig in saved.items():
            setattr(dist, name, orig)


# -----------------------------------------------------------------------------
# training


def get_batch(step: int, micro: int, rank: int, args: argparse.Namespace) -> Any:
    # Synthetic data: each (step, micro-step, rank) has its own batch, as a sampler gives.
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    data = torch.randint(0, args.vocab, (args.batch_size, args.block_size + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def get_lr(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    ratio = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * 0.1 + 0.5 * args.lr * 0.9 * (1 + math.cos(math.pi * ratio))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wrapper", choices=WRAPPERS, default="ddp")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=32)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--out-dir", default="")
    p.add_argument("--count-collectives", action="store_true")
    args = p.parse_args(argv)

    if not dist.is_initialized():  # under torchrun: the env:// rendezvous
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    master = rank == 0
    torch.manual_seed(1337)  # the same initial weights on every rank

    model = GPT(args.vocab, args.block_size, args.n_layer, args.n_embd, args.n_head)
    model, collectives = wrap(model, args.wrapper, args.count_collectives)
    # weight decay on matrices only (embeddings and linear weights), as nanoGPT
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))

    losses: list[float] = []
    per_step: list[dict[str, int]] = []
    fsdp2_counts: Counter = Counter()
    with counting_torch_collectives(
        fsdp2_counts, args.count_collectives and args.wrapper == "fsdp2"
    ):
        for step in range(args.steps):
            for group in optimizer.param_groups:
                group["lr"] = get_lr(step, args)
            before = collectives() + fsdp2_counts
            loss_accum = 0.0
            for micro in range(args.grad_accum):
                last = micro == args.grad_accum - 1
                if args.wrapper == "fsdp2":
                    model.set_requires_gradient_sync(last)
                else:
                    # only sync gradients on the last micro step (DDP's flag, honoured by
                    # cadence's wrappers too)
                    model.require_backward_grad_sync = last
                x, y = get_batch(step, micro, rank, args)
                loss = model(x, y) / args.grad_accum
                loss.backward()
                loss_accum += loss.item()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            after = collectives() + fsdp2_counts
            per_step.append(dict(after - before))
            # the mean loss over ranks, for logging
            mean = torch.tensor(loss_accum)
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            if master:
                print(f"step {step}: loss {losses[-1]:.6f}, grad norm {float(norm):.4f}")
    if args.count_collectives and master:
        print("gradient collectives per step:", per_step)

    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        if args.wrapper in ("ddp", "cadence-dp"):  # replicas: rank 0 saves the model
            if master:
                torch.save(
                    {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                    os.path.join(args.out_dir, "ckpt.pt"),
                )
        else:  # sharded: every rank saves its shards
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                os.path.join(args.out_dir, f"ckpt.{rank}.pt"),
            )
        dist.barrier()
    return {"losses": losses, "collectives": per_step}


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
