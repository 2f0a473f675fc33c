"""Models, steps and rank bodies shared by the precompile tests (importable by ranks)."""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cadence
from cadence.comm import EventLog
from cadence.precompiling import _share, precompile, precompile_module, stats
from cadence.testing import max_abs_diff, named_grads, named_params, shard

BACKEND = "aot_eager"  # a real AOTAutograd compile without the C++ build: fast on CPU

SCALE = 2.0
W = torch.ones(2)
P = torch.nn.Parameter(torch.ones(2))
LOSS = torch.nn.MSELoss()
FLAG: list[str] = []


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.drop = torch.nn.Dropout(0.0)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.tanh(self.a(x))))


def step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x) * SCALE, y)


def step_reading_w(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) * W).sum()


def step_reading_p(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) * P).sum()


def step_with_stateless_global(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    return LOSS(model(x), y)


def step_with_tensor_default(
    model: torch.nn.Module,
    x: torch.Tensor,
    w: torch.Tensor = torch.ones(2),  # noqa: B008
) -> torch.Tensor:
    return (model(x) * w).sum()


def make_closure_step(w: torch.Tensor) -> Any:
    def closure_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return (model(x) * w).sum()

    return closure_step


def make_nested_step(w: torch.Tensor) -> Any:
    def helper(y: torch.Tensor) -> torch.Tensor:
        return y * w

    def nested_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return helper(model(x)).sum()

    return nested_step


def make_module_step(model: torch.nn.Module) -> Any:
    def module_step(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    return module_step


def scaled_step(model: torch.nn.Module, x: torch.Tensor, scale: float) -> torch.Tensor:
    return (model(x) * scale).sum()


def data_dependent(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:  # a graph break: fullgraph compile refuses it
        return x
    return -x


def set_flag() -> None:
    FLAG.append("unpickled")


class Boom:
    """Unpickling this sets FLAG: proves whether a payload reached the unpickler."""

    def __reduce__(self) -> Any:
        return set_flag, ()


def inputs(seed: int = 0, batch: int = 3) -> tuple[TinyNet, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return TinyNet(), torch.randn(batch, 4), torch.randn(batch, 2)


def loss_and_grads(fn: Any, model: torch.nn.Module, *args: Any) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    loss = fn(model, *args)
    loss.backward()
    return {"loss": loss.detach(), "grads": named_grads(model)}


# ---------------------------------------------------------------------------------------
# Fresh-process bodies (cadence.launch with init_process_group=False)
# ---------------------------------------------------------------------------------------


def fresh_body(cache_dir: str, backend: str) -> dict[str, Any]:
    """Compile (or load) ``step`` after a first backward, then train two SGD steps."""
    model, x, y = inputs()
    eager = copy.deepcopy(model)
    loss_and_grads(step, model, x, y)  # parameters have .grad when compiling
    compiled = precompile(step, (model, x, y), cache_dir=cache_dir, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    out: dict[str, Any] = {"source": compiled.source, "stats": stats(), "steps": []}
    for _ in range(2):
        got = loss_and_grads(compiled, model, x, y)
        want = loss_and_grads(step, eager, x, y)
        out["steps"].append({"compiled": got, "eager": want})
        opt.step()
        eager_opt.step()
    out["params"] = named_params(model)
    out["eager_params"] = named_params(eager)
    out["timings"] = dict(compiled.timings)
    inductor = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    out["libraries"] = sorted(f"{p.parent.name}/{p.name}" for p in inductor.glob("??/*.so"))
    return out


# ---------------------------------------------------------------------------------------
# Two-rank bodies
# ---------------------------------------------------------------------------------------


def _heartbeats(log: EventLog) -> dict[str, Any]:
    """`Channel.send` keeps the group alive with status broadcasts while it produces."""
    channel = _share.Channel(dist.group.WORLD, 0, log)
    if channel.rank == 0:

        def produce() -> bytes:
            # Wait, asleep, until the heartbeat thread has sent three statuses.
            while log.count("broadcast") < 3:
                time.sleep(0.01)
            return b"payload"

        data = channel.send(produce)
    else:
        data = channel.receive()
    return {"data": data, "broadcasts": log.count("broadcast")}


def _failure() -> str:
    try:
        precompile(data_dependent, (torch.randn(3),), backend=BACKEND)
    except cadence.precompiling.PrecompileError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _mismatch() -> str:
    rank = dist.get_rank()
    try:
        precompile(torch.sin, (torch.randn(2 + rank),), backend=BACKEND)
    except cadence.precompiling.RankMismatchError as exc:
        return str(exc)
    return "no error"


def _not_a_member() -> str:
    """A rank outside the group it passes is refused before any collective."""
    only_rank0 = dist.new_group([0])  # every rank takes part in creating the group
    if dist.get_rank() == 0:
        return "member"
    try:
        precompile(torch.sin, (torch.randn(2),), group=only_rank0, backend=BACKEND)
    except cadence.precompiling.PrecompileUsageError as exc:
        return str(exc)
    return "no error"


def _counted(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, int]:
    before = stats()["compiles"]
    result = fn(*args, **kwargs)
    return result, stats()["compiles"] - before


def two_rank_body(cache_dir: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"rank": rank}
    _share.HEARTBEAT_S = 0.05
    out["heartbeat"] = _heartbeats(EventLog())
    out["mismatch"] = _mismatch()
    out["not_a_member"] = _not_a_member()
    out["failure"] = _failure()

    # A DataParallel-wrapped model whose forward is precompiled: parity with
    # single-process training on the concatenated batch, two SGD steps.
    model, x_all, y_all = inputs(batch=4 * world)
    reference = copy.deepcopy(model)
    dp = cadence.DataParallel(model)
    x, y = shard(x_all, rank, world), shard(y_all, rank, world)
    log = EventLog()
    compiled, out["dp_compiles"] = _counted(
        precompile_module, model, (x,), cache_dir=cache_dir, backend=BACKEND, event_log=log
    )
    out["dp_source"] = compiled.source
    out["dp_timings"] = dict(compiled.timings)
    out["dp_broadcasts"] = log.count("broadcast")
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    diffs = []
    for _ in range(2):
        loss = F.mse_loss(dp(x), y)
        loss.backward()
        ref_loss = F.mse_loss(reference(x_all), y_all)
        ref_loss.backward()
        diffs.append(max_abs_diff(named_grads(model), named_grads(reference)))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["dp_grad_diffs"] = diffs
    out["dp_param_diff"] = max_abs_diff(named_params(model), named_params(reference))

    # A plain step function, its model passed as an argument; the group given as the
    # topology object (its data-parallel group).
    groups = cadence.init()
    net, xs, ys = inputs(seed=1)
    fn, out["step_compiles"] = _counted(
        precompile, step, (net, xs, ys), group=groups, cache_dir=cache_dir, backend=BACKEND
    )
    out["step_source"] = fn.source
    out["step_diff"] = max_abs_diff(
        loss_and_grads(fn, net, xs, ys), loss_and_grads(step, copy.deepcopy(net), xs, ys)
    )
    return out
