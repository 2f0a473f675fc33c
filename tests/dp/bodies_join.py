"""Rank bodies: ``DataParallel.join()`` on uneven inputs against torch DDP's ``join()``.

One launch at world 3; the world-2 cases run on ranks 0 and 1 over a subgroup (rank
2 sits them out), so ``process_group=`` is exercised as well. Rank ``r`` trains on
``1 + 2r`` batches. Every case returns numbers: parameter differences against
torch DDP given the same batches, collective counts from the event log and from a
counting comm hook on torch DDP, the event-log signature (compared across ranks by
the test), or "ok" for a refusal whose message was checked.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import cadence
from cadence.data_parallel import comm_hooks
from cadence.testing import max_abs_diff, run_subtests
from tests.dp.common import expect_error

WIDTH = 8


class _Net(nn.Module):
    """Linear, BatchNorm (buffers to broadcast), and an ``extra`` head used only sometimes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.head = nn.Linear(WIDTH, 1)
        self.extra = nn.Linear(WIDTH, 1)
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn(self.lin(x)))
        return self.head(h) + self.extra(h) if self.use_extra else self.head(h)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, 1, generator=g)


def _num_batches(rank: int) -> int:
    return 1 + 2 * rank


def _train_steps(m: nn.Module, opt: Any, n: int, *, find_unused: bool) -> None:
    rank = dist.get_rank()
    for step in range(n):
        # With find_unused_parameters, ranks disagree on whether ``extra`` is used.
        m.module.use_extra = not find_unused or (step + rank) % 2 == 0  # type: ignore[union-attr]
        x, y = _batch(rank, step)
        F.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v.detach().clone() for k, v in m.state_dict().items()}


def _counting_hook(inner: Callable[..., Any]) -> tuple[Callable[..., Any], list[int]]:
    calls: list[int] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # torch checks annotations
        calls.append(bucket.buffer().numel())
        return inner(state, bucket)

    return hook, calls


def _models(
    pg: dist.ProcessGroup | None, *, hook: str | None, log: cadence.EventLog, **kwargs: Any
) -> tuple[list[nn.Module], list[int], list[int]]:
    """[cadence, torch DDP, torch DDP counting its bucket all-reduces with a comm hook].

    Without ``hook`` the parity oracle is the DDP without a hook: a comm hook makes
    DDP ignore ``divide_by_initial_world_size``. The counting DDP issues the same
    bucket all-reduces either way. ``hook``: cadence gets torch's allreduce hook
    (returns a Future) or cadence's own (returns a work); torch DDP torch's.
    """
    model = _Net()
    dp = cadence.DataParallel(copy.deepcopy(model), process_group=pg, event_log=log, **kwargs)
    ddp = DDP(copy.deepcopy(model), process_group=pg, **kwargs)
    counting = DDP(copy.deepcopy(model), process_group=pg, **kwargs)
    ddp_hook, ddp_calls = _counting_hook(default_hooks.allreduce_hook)
    counting.register_comm_hook(pg, ddp_hook)
    dp_calls: list[int] = []
    if hook is not None:
        ddp.register_comm_hook(pg, default_hooks.allreduce_hook)
        inner = default_hooks.allreduce_hook if hook == "torch" else comm_hooks.allreduce_hook
        dp_hook, dp_calls = _counting_hook(inner)
        # cadence's hook reads its group from the bucket when the state is not a Comm.
        dp.register_comm_hook(pg if hook == "torch" else None, dp_hook)
    return [dp, ddp, counting], ddp_calls, dp_calls


def _parity(
    world: int,
    buffers: bool,
    find_unused: bool,
    divide: bool,
    *,
    groups: dict[int, dist.ProcessGroup | None],
    hook: str | None = None,
) -> dict[str, Any] | None:
    rank = dist.get_rank()
    if rank >= world:
        return None
    pg = groups[world]
    log = cadence.EventLog()
    models, ddp_calls, dp_calls = _models(
        pg, hook=hook, log=log, forward_sync_buffers=buffers, find_unused_parameters=find_unused
    )
    dp, ddp, _ = models
    for m in models:
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        with m.join(divide_by_initial_world_size=divide):
            _train_steps(m, opt, _num_batches(rank), find_unused=find_unused)
    grads = [e for e in log.collectives("all_reduce", group="dp") if e.dtype == "float32"]
    return {
        "vs_ddp": max_abs_diff(_state(dp), _state(ddp)),
        "params": torch.cat([p.detach().reshape(-1) for p in dp.parameters()]),
        "buffers": torch.cat([b.double().reshape(-1) for b in dp.buffers()]),
        "max_batches": _num_batches(world - 1),
        "num_buckets": dp.num_buckets,
        "grad_all_reduces": len(grads),
        "ddp_hook_calls": len(ddp_calls),
        "dp_hook_calls": len(dp_calls),
        "used_map_all_reduces": sum(
            e.dtype == "int32" for e in log.collectives("all_reduce", group="dp")
        ),
        "join_all_reduces": log.count("all_reduce", group="dp.join"),
        "signature": [(e.kind, e.group, e.numel, e.dtype) for e in log.collectives()],
    }


def _throw(world: int, *, groups: dict[int, dist.ProcessGroup | None]) -> dict[str, Any] | None:
    """throw_on_early_termination: every rank raises when rank 0 runs out (after 1 step)."""
    rank = dist.get_rank()
    if rank >= world:
        return None
    log = cadence.EventLog()
    dp, ddp, _ = _models(groups[world], hook=None, log=log)[0]
    out: dict[str, Any] = {}
    for name, m in (("dp", dp), ("ddp", ddp)):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        done = 0
        try:
            with m.join(throw_on_early_termination=True):
                for step in range(_num_batches(rank)):
                    x, y = _batch(rank, step)
                    F.mse_loss(m(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                    done += 1
            out[f"{name}_raised"] = ""
        except RuntimeError as exc:
            out[f"{name}_raised"] = str(exc)
        out[f"{name}_steps"] = done
    out["vs_ddp"] = max_abs_diff(_state(dp), _state(ddp))
    # The join is over: a plain step issues no join bookkeeping and is not refused.
    before = log.count("all_reduce", group="dp.join")
    with dp.no_sync():
        F.mse_loss(dp(_batch(0, 9)[0]), _batch(0, 9)[1]).backward()
    out["join_all_reduces_after"] = log.count("all_reduce", group="dp.join") - before
    return out


def _disabled() -> dict[str, Any]:
    """enable=False: a no-op context (even inputs); no_sync stays allowed inside it.

    Without forward buffer sync: torch DDP skips the buffer broadcast after a
    no_sync forward and cadence does not, which this case is not about.
    """
    log = cadence.EventLog()
    models, ddp_calls, _ = _models(None, hook=None, log=log, forward_sync_buffers=False)
    dp, ddp, _ = models
    rank = dist.get_rank()
    for m in models:
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        with m.join(enable=False):
            with m.no_sync():
                F.mse_loss(m(_batch(rank, 0)[0]), _batch(rank, 0)[1]).backward()
            F.mse_loss(m(_batch(rank, 1)[0]), _batch(rank, 1)[1]).backward()
            opt.step()
    return {
        "vs_ddp": max_abs_diff(_state(dp), _state(ddp)),
        "join_all_reduces": log.count("all_reduce", group="dp.join"),
        "grad_all_reduces": log.count("all_reduce", group="dp"),
        "ddp_hook_calls": len(ddp_calls),
    }


def _generic_zero() -> dict[str, Any]:
    """``Join([model, ZeroRedundancyOptimizer])``, torch's generic form, against DDP's."""
    rank = dist.get_rank()
    log = cadence.EventLog()
    models, ddp_calls, _ = _models(None, hook=None, log=log)
    dp, ddp, _ = models
    for m in models:
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.SGD, lr=0.05)
        with Join([m, opt], divide_by_initial_world_size=False):
            _train_steps(m, opt, _num_batches(rank), find_unused=False)
    return {
        "vs_ddp": max_abs_diff(_state(dp), _state(ddp)),
        "params": torch.cat([p.detach().reshape(-1) for p in dp.parameters()]),
        "grad_all_reduces": log.count("all_reduce", group="dp"),
        "ddp_hook_calls": len(ddp_calls),
    }


def _inside_join(dp: cadence.DataParallel, action: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        with dp.join():
            action()

    return run


def _refusals() -> dict[str, str]:
    """Each setting joined ranks cannot shadow, refused before any collective."""
    log = cadence.EventLog()

    def fresh(**kwargs: Any) -> cadence.DataParallel:
        return cadence.DataParallel(_Net(), event_log=log, **kwargs)

    out: dict[str, str] = {}
    dp = fresh()
    dp.require_manual_backward_finalization = True
    out["manual"] = expect_error(dp.join, "require_manual_backward_finalization=True", "False")
    # The refused join() left no join mode behind: a plain step has no join bookkeeping.
    dp.require_manual_backward_finalization = False
    dp(_batch(0, 0)[0]).sum().backward()
    out["left_after_refusal"] = (
        "ok" if log.count(group="dp.join") == 0 else f"join bookkeeping: {log.counts()}"
    )
    dp = fresh()
    out["manual_inside"] = expect_error(
        _inside_join(dp, lambda: dp.set_manual_backward_finalization(True)),
        "require_manual_backward_finalization=True inside DataParallel.join()",
    )
    out["static_graph"] = expect_error(fresh(static_graph=True).join, "static_graph=True")
    dp = fresh()
    out["set_static_graph_inside"] = expect_error(
        _inside_join(dp, dp._set_static_graph), "_set_static_graph() inside"
    )
    dp = fresh()
    out["no_sync_inside"] = expect_error(
        _inside_join(dp, lambda: dp.no_sync().__enter__()),
        "no_sync() inside",
        "accumulate gradients outside the join context",
    )
    dp = fresh()
    out["grad_sync_off_inside"] = expect_error(
        _inside_join(dp, lambda: setattr(dp, "require_backward_grad_sync", False)),
        "turning gradient sync off inside",
    )
    dp = fresh()
    dp.require_backward_grad_sync = False
    out["grad_sync_off_at_entry"] = expect_error(dp.join, "gradient sync is off")
    dp = fresh()
    with dp.no_sync():
        out["no_sync_at_entry"] = expect_error(dp.join, "gradient sync is off")
    dp = fresh()
    out["split_backward_inside"] = expect_error(
        _inside_join(dp, lambda: dp.split_backward("weight").__enter__()),
        "split_backward() inside",
    )
    out["unknown_option"] = expect_error(
        lambda: Join([fresh()], divide_by_initial_world_size=True, gradient_scale=2),
        "gradient_scale",
        "divide_by_initial_world_size only",
    )
    dp = fresh()
    opt = ZeroRedundancyOptimizer(dp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)

    def not_first() -> None:
        with Join([opt, dp], divide_by_initial_world_size=False):
            dp(_batch(0, 0)[0])

    out["divide_not_first"] = expect_error(not_first, "first joinable", "Join([model, optimizer")
    dp = fresh()
    dp.register_comm_hook(None, default_hooks.allreduce_hook)
    out["divide_with_comm_hook"] = expect_error(
        lambda: dp.join(divide_by_initial_world_size=False), "with a comm hook", "Pass True"
    )
    # Every refusal above was raised before any collective of its own.
    grads = log.count("all_reduce", group="dp")  # the one plain step above
    out["no_collectives"] = (
        "ok"
        if log.count("all_reduce") == grads == 1
        else f"refusals issued collectives: {log.counts()}"
    )
    return out


def join_suite() -> dict[str, Any]:
    pair = dist.new_group([0, 1])
    groups: dict[int, dist.ProcessGroup | None] = {2: pair, 3: None}
    grid = {
        "world": [2, 3],
        "buffers": [True, False],
        "find_unused": [False, True],
        "divide": [True, False],
    }
    return {
        "parity": run_subtests(grid, _parity, groups=groups),
        "hooks": run_subtests(
            {
                "world": [2, 3],
                "buffers": [True],
                "find_unused": [False, True],
                "divide": [True],
                "hook": ["torch", "cadence"],
            },
            _parity,
            groups=groups,
        ),
        "throw": run_subtests({"world": [2, 3]}, _throw, groups=groups),
        "disabled": _disabled(),
        "generic_zero": _generic_zero(),
        "refusals": _refusals(),
    }
