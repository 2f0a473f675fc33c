"""Rank bodies: stage boundaries of several tensors, and a weight tied across stages.

The model: stage 0 embeds the tokens and passes ``(hidden, embedding)`` on; middle
stages transform the hidden state and relay the embedding; the last stage adds the
embedding back (a skip connection carried across the boundaries) and projects onto
the vocabulary with a head tied to stage 0's embedding table (its own copy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cadence import EventLog
from cadence.fsdp import fully_shard
from cadence.models import MarkovTokens
from cadence.pipeline.runtime import build_pipeline
from cadence.pipeline.runtime.executor import _p2p_runs
from cadence.pipeline.schedule import placement_for
from cadence.testing import max_abs_diff, run_subtests

V, D, T = 16, 8, 4
M = 4


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.lin = nn.Linear(D, D)

    def forward(self, tok):
        e = self.emb(tok)
        return torch.tanh(self.lin(e)), e


class Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h, e):
        return torch.tanh(self.lin(h)), e


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.head = nn.Parameter(torch.empty(V, D))

    def forward(self, h, e):
        return (torch.tanh(self.lin(h)) + e) @ self.head.t()


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def stages(n: int) -> list[nn.Module]:
    torch.manual_seed(5)
    mods = [First()] + [Middle() for _ in range(n - 2)] + [Last()]
    with torch.no_grad():
        mods[-1].head.copy_(mods[0].emb.weight)  # the copies start equal
    return mods


def reference(n: int, x, y) -> dict[str, torch.Tensor]:
    mods = stages(n)
    mods[-1].head = mods[0].emb.weight  # one tensor: its gradient is the sum of both uses
    out = mods[0](x)
    for m in mods[1:-1]:
        out = m(*out)
    loss_fn(mods[-1](*out), y).backward()
    return {f"{s}.{k}": p.grad for s, m in enumerate(mods) for k, p in m.named_parameters()}


def case(
    name: str, v: int, pg=None, wrap: bool = False, mode: str = "per_directed_edge", batch=False
) -> dict:
    p = dist.get_world_size() // (1 if pg is None else pg.dp_size)
    n = p * v
    rank = dist.get_rank() if pg is None else pg.pp_rank
    mine = sorted(s for s, r in placement_for(name, p, v).items() if r == rank)
    mods = stages(n)
    log = EventLog()
    if wrap:
        for s in mine:
            fully_shard(mods[s], group=pg)
    rt = build_pipeline(
        name,
        mods,
        n_microbatches=M,
        chunks=v,
        groups=pg,
        loss_fn=loss_fn,
        tied_parameters=[[(0, "emb.weight"), (n - 1, "head")]],
        channel_mode=mode,  # type: ignore[arg-type]
        batch_p2p=batch,
        event_log=log,
    )
    x, y = MarkovTokens(V, T, seed=2).batch(0, 4 * M)
    rows = slice(None) if pg is None else pg.local_slice(x.shape[0])
    log.clear()
    rt.step(x[rows], target=y[rows])
    want = reference(n, x, y)
    transfers = [a for a in rt.actions if a.kind.name in ("SEND", "RECV")]
    p2p = [e for e in log.collectives() if e.kind in ("send", "recv")]

    def full(g):
        return g.full_tensor() if hasattr(g, "full_tensor") else g

    got = {f"{s}.{k}": full(q.grad) for s in mine for k, q in mods[s].named_parameters()}
    tie = [k for k in got if k in ("0.emb.weight", f"{n - 1}.head")]
    return {
        "grad_diff": max_abs_diff(got, {k: want[k] for k in got}),
        # the last stage's head copy equals the reference's one shared gradient
        "tie_vs_ref": max_abs_diff(
            {k: got[k] for k in tie}, {k: want["0.emb.weight"] for k in tie}
        ),
        "n_tied_here": len(tie),
        "local_tie": len({placement_for(name, p, v)[s] for s in (0, n - 1)}) == 1,
        "transfers": len(transfers),
        "p2p_ops": len(p2p),  # two tensors per boundary: two ops per transfer
        "batches": rt.p2p_batches,
        # the longest run of consecutive SEND/RECV actions (what one batch can hold)
        "longest_run": max(len(r) for r in _p2p_runs(rt.actions).values()),
    }


def body_world2(schedules: list[tuple[str, int]], shared: list[tuple[str, int]]) -> dict:
    def one(name_v, mode, batch):
        return case(*name_v, mode=mode, batch=batch)

    edge = "per_directed_edge"
    batched = {"name_v": schedules, "mode": [edge], "batch": [True]}
    single = {"name_v": [("1f1b", 1), ("zbv", 2)], "mode": [edge], "batch": [False]}
    one_group = {"name_v": shared, "mode": ["shared"], "batch": [False, True]}
    per_direction = {"name_v": [("zbv", 2)], "mode": ["per_direction"], "batch": [True]}
    return {
        **run_subtests(batched, one),
        **run_subtests(single, one),
        **run_subtests(one_group, one),
        **run_subtests(per_direction, one),
    }
