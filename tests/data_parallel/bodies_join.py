"""Scenarios: ``DataParallel.join()`` on uneven inputs against torch DDP's ``join()``.

One launch at world 3; the world-2 cases run on ranks 0 and 1 over a subgroup (rank
2 sits them out), so ``process_group=`` is exercised as well. Rank ``r`` trains on
``1 + 2r`` batches. Each scenario checks parameter differences against torch DDP
given the same batches, collective counts from the event log and from a counting
comm hook on torch DDP, the event-log signature across ranks, or a refusal's message.
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
from cadence.testing import max_abs_diff
from tests._scenarios import Scenario, assert_raises, cases

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


_GROUPS: dict[int, dist.ProcessGroup | None] = {}


def _groups() -> dict[int, dist.ProcessGroup | None]:
    """World size -> its group: ranks 0 and 1 for 2, the default group for 3.

    Made once per process, by the first scenario that needs it (on every rank).
    """
    if not _GROUPS:
        _GROUPS.update({2: dist.new_group([0, 1]), 3: None})
    return _GROUPS


def _gather(value: Any, pg: dist.ProcessGroup | None) -> list[Any]:
    everyone: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, value, group=pg)
    return everyone


def _train_joined(
    world: int, buffers: bool, find_unused: bool, divide: bool, hook: str | None = None
) -> dict[str, Any]:
    """Train cadence and torch DDP under ``join()``; what the checks need (participants only)."""
    rank = dist.get_rank()
    pg = _groups()[world]
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


def parity_with_ddp_join(
    world: int, buffers: bool, find_unused: bool, divide: bool, hook: str | None = None
) -> None:
    """Same parameters and buffers as torch DDP's join(), and the same collectives."""
    pg = _groups()[world]
    if dist.get_rank() >= world:
        return
    r = _train_joined(world, buffers, find_unused, divide, hook)
    assert r["vs_ddp"] <= 1e-6, f"differs from torch DDP by {r['vs_ddp']:.3e}"
    # Every rank, active or joined, issues one all-reduce per bucket per step of the rank
    # with the most batches, as DDP (counted by its comm hook).
    steps = r["max_batches"] * r["num_buckets"]
    counts = {k: v for k, v in r.items() if isinstance(v, int)}
    if hook is not None:  # counted by the hooks (torch's bypasses the event log)
        assert r["dp_hook_calls"] == r["ddp_hook_calls"] == steps, counts
    if hook != "torch":
        assert r["grad_all_reduces"] == r["ddp_hook_calls"] == steps, counts
    assert r["used_map_all_reduces"] == (r["max_batches"] if find_unused else 0), counts
    # Per step: the sync flag, plus the source-rank pick with buffers; then one
    # source-rank pick for the final model broadcast.
    per_step = 2 if buffers else 1
    assert r["join_all_reduces"] == r["max_batches"] * per_step + 1, counts
    everyone = _gather(r, pg)
    assert len(everyone) == world, f"{len(everyone)} participants"
    first = everyone[0]
    # Joined ranks shadowed exactly the active ranks' collectives.
    assert r["signature"] == first["signature"], (r["signature"], first["signature"])
    # The final model is the same on every rank (buffers too when broadcast).
    assert torch.equal(r["params"], first["params"]), "parameters differ across ranks"
    if buffers:
        assert torch.equal(r["buffers"], first["buffers"]), "buffers differ across ranks"


def _grid(**axes: list[Any]) -> list[dict[str, Any]]:
    combos: list[dict[str, Any]] = [{}]
    for key, values in axes.items():
        combos = [{**c, key: v} for c in combos for v in values]
    return combos


def _label(case: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in case.items())


PARITY = _grid(world=[2, 3], buffers=[True, False], find_unused=[False, True], divide=[True, False])
HOOKS = _grid(
    world=[2, 3],
    buffers=[True],
    find_unused=[False, True],
    divide=[True],
    hook=["torch", "cadence"],
)


def divide_by_initial_world_size_changes_the_result() -> None:
    """Not a vacuous flag: averaging over the active ranks gives other parameters."""
    a = _train_joined(3, True, False, True)["params"]
    b = _train_joined(3, True, False, False)["params"]
    diff = float((a - b).abs().max())
    assert diff > 1e-4, f"divide_by_initial_world_size=False changed parameters by {diff:.3e}"


def throw_on_early_termination(world: int) -> None:
    """Every rank raises when rank 0 runs out (after the one step they all had), as DDP."""
    rank = dist.get_rank()
    pg = _groups()[world]
    if rank >= world:
        return
    log = cadence.EventLog()
    dp, ddp, _ = _models(pg, hook=None, log=log)[0]
    raised: dict[str, str] = {}
    steps: dict[str, int] = {}
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
            raised[name] = ""
        except RuntimeError as exc:
            raised[name] = str(exc)
        steps[name] = done
    assert steps["dp"] == steps["ddp"] == 1, steps
    assert raised["dp"] and raised["ddp"], raised
    expected = "exhausted all inputs" if rank == 0 else "exhausted inputs"
    assert expected in raised["dp"], raised["dp"]
    vs_ddp = max_abs_diff(_state(dp), _state(ddp))
    assert vs_ddp <= 1e-6, f"differs from torch DDP by {vs_ddp:.3e}"
    # The join is over: a plain step issues no join bookkeeping and is not refused.
    before = log.count("all_reduce", group="dp.join")
    with dp.no_sync():
        F.mse_loss(dp(_batch(0, 9)[0]), _batch(0, 9)[1]).backward()
    after = log.count("all_reduce", group="dp.join") - before
    assert after == 0, f"{after} join all-reduces after the join ended"


def enable_false_is_a_no_op() -> None:
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
    vs_ddp = max_abs_diff(_state(dp), _state(ddp))
    assert vs_ddp <= 1e-6, f"differs from torch DDP by {vs_ddp:.3e}"
    assert log.count("all_reduce", group="dp.join") == 0, log.counts()
    grads = log.count("all_reduce", group="dp")
    assert grads == len(ddp_calls) == 1, (grads, len(ddp_calls))


def generic_join_with_zero_redundancy_optimizer() -> None:
    """``Join([model, ZeroRedundancyOptimizer])``, torch's generic form, against DDP's."""
    rank = dist.get_rank()
    log = cadence.EventLog()
    models, ddp_calls, _ = _models(None, hook=None, log=log)
    dp, ddp, _ = models
    for m in models:
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.SGD, lr=0.05)
        with Join([m, opt], divide_by_initial_world_size=False):
            _train_steps(m, opt, _num_batches(rank), find_unused=False)
    vs_ddp = max_abs_diff(_state(dp), _state(ddp))
    assert vs_ddp <= 1e-6, f"differs from torch DDP by {vs_ddp:.3e}"
    grads = log.count("all_reduce", group="dp")
    assert grads == len(ddp_calls) == 5, (grads, len(ddp_calls))
    params = torch.cat([p.detach().reshape(-1) for p in dp.parameters()])
    assert torch.equal(params, _gather(params, None)[0]), "parameters differ from rank 0's"


def _inside_join(dp: cadence.DataParallel, action: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        with dp.join():
            action()

    return run


def _fresh(log: cadence.EventLog, **kwargs: Any) -> cadence.DataParallel:
    return cadence.DataParallel(_Net(), event_log=log, **kwargs)


def _refused(build: Callable[[cadence.EventLog], Callable[[], Any]], *fragments: str) -> None:
    """``build(log)()`` raises naming ``fragments``, before any collective of its own."""
    log = cadence.EventLog()
    refused = build(log)
    log.clear()
    assert_raises(refused, *fragments)
    assert log.count("all_reduce") == 0, f"the refusal issued collectives: {log.counts()}"


def refused_join_leaves_no_join_mode_behind() -> None:
    log = cadence.EventLog()
    dp = _fresh(log)
    dp.require_manual_backward_finalization = True
    assert_raises(dp.join, "require_manual_backward_finalization=True")
    # The refused join() left no join mode behind: a plain step has no join bookkeeping.
    dp.require_manual_backward_finalization = False
    dp(_batch(0, 0)[0]).sum().backward()
    assert log.count(group="dp.join") == 0, f"join bookkeeping: {log.counts()}"
    assert log.count("all_reduce") == 1, f"one plain step: {log.counts()}"


def _manual(log: cadence.EventLog) -> Callable[[], Any]:
    dp = _fresh(log)
    dp.require_manual_backward_finalization = True
    return dp.join


def _manual_inside(log: cadence.EventLog) -> Callable[[], None]:
    dp = _fresh(log)
    return _inside_join(dp, lambda: dp.set_manual_backward_finalization(True))


def _set_static_graph_inside(log: cadence.EventLog) -> Callable[[], None]:
    dp = _fresh(log)
    return _inside_join(dp, dp._set_static_graph)


def _no_sync_inside(log: cadence.EventLog) -> Callable[[], None]:
    dp = _fresh(log)
    return _inside_join(dp, lambda: dp.no_sync().__enter__())


def _grad_sync_off_inside(log: cadence.EventLog) -> Callable[[], None]:
    dp = _fresh(log)
    return _inside_join(dp, lambda: setattr(dp, "require_backward_grad_sync", False))


def _grad_sync_off_at_entry(log: cadence.EventLog) -> Callable[[], Any]:
    dp = _fresh(log)
    dp.require_backward_grad_sync = False
    return dp.join


def _no_sync_at_entry(log: cadence.EventLog) -> Callable[[], None]:
    dp = _fresh(log)

    def run() -> None:
        # Refused inside the no_sync context; the context then exits normally.
        caught: list[cadence.CadenceError] = []
        with dp.no_sync():
            try:
                dp.join()
            except cadence.CadenceError as exc:
                caught.append(exc)
        if caught:
            raise caught[0]

    return run


def _split_backward_inside(log: cadence.EventLog) -> Callable[[], None]:
    dp = _fresh(log)
    return _inside_join(dp, lambda: dp.split_backward("weight").__enter__())


def _divide_not_first(log: cadence.EventLog) -> Callable[[], None]:
    dp = _fresh(log)
    opt = ZeroRedundancyOptimizer(dp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)

    def not_first() -> None:
        with Join([opt, dp], divide_by_initial_world_size=False):
            dp(_batch(0, 0)[0])

    return not_first


def _divide_with_comm_hook(log: cadence.EventLog) -> Callable[[], Any]:
    dp = _fresh(log)
    dp.register_comm_hook(None, default_hooks.allreduce_hook)
    return lambda: dp.join(divide_by_initial_world_size=False)


# Each setting joined ranks cannot shadow: name -> (build the refused call, message fragments).
REFUSALS: dict[str, tuple[Callable[[cadence.EventLog], Callable[[], Any]], tuple[str, ...]]] = {
    "manual": (_manual, ("require_manual_backward_finalization=True", "False")),
    "manual_inside": (
        _manual_inside,
        ("require_manual_backward_finalization=True inside DataParallel.join()",),
    ),
    "static_graph": (lambda log: _fresh(log, static_graph=True).join, ("static_graph=True",)),
    "set_static_graph_inside": (_set_static_graph_inside, ("_set_static_graph() inside",)),
    "no_sync_inside": (
        _no_sync_inside,
        ("no_sync() inside", "accumulate gradients outside the join context"),
    ),
    "grad_sync_off_inside": (_grad_sync_off_inside, ("turning gradient sync off inside",)),
    "grad_sync_off_at_entry": (_grad_sync_off_at_entry, ("gradient sync is off",)),
    "no_sync_at_entry": (_no_sync_at_entry, ("gradient sync is off",)),
    "split_backward_inside": (_split_backward_inside, ("split_backward() inside",)),
    "unknown_option": (
        lambda log: (
            lambda: Join([_fresh(log)], divide_by_initial_world_size=True, gradient_scale=2)
        ),
        ("gradient_scale", "divide_by_initial_world_size only"),
    ),
    "divide_not_first": (_divide_not_first, ("first joinable", "Join([model, optimizer")),
    "divide_with_comm_hook": (_divide_with_comm_hook, ("with a comm hook", "Pass True")),
}


def refused(setting: str) -> None:
    """Refused before any collective, naming the setting and the fix."""
    build, fragments = REFUSALS[setting]
    _refused(build, *fragments)


SCENARIOS = [
    *(Scenario(f"parity_with_ddp_join-{_label(c)}", parity_with_ddp_join, c) for c in PARITY),
    *(Scenario(f"parity_with_ddp_join-{_label(c)}", parity_with_ddp_join, c) for c in HOOKS),
    Scenario(
        divide_by_initial_world_size_changes_the_result.__name__,
        divide_by_initial_world_size_changes_the_result,
    ),
    *cases(throw_on_early_termination, "world", [2, 3]),
    Scenario(enable_false_is_a_no_op.__name__, enable_false_is_a_no_op),
    Scenario(
        generic_join_with_zero_redundancy_optimizer.__name__,
        generic_join_with_zero_redundancy_optimizer,
    ),
    *cases(refused, "setting", list(REFUSALS)),
    Scenario(
        refused_join_leaves_no_join_mode_behind.__name__, refused_join_leaves_no_join_mode_behind
    ),
]
