"""Scenarios: nn.Module methods applied to a model after DataParallel wrapped it.

Honoured methods must train exactly like one process on the global batch (starting
from the values the method left), with every buffer still broadcast from rank 0.
Refused methods must raise a `DataParallelError` naming the method (or the
parameter) and the fix, before anything changed where the wrapper is called.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cadence
from cadence.testing import max_abs_diff
from tests._scenarios import Scenario, assert_raises, cases, scenarios
from tests.data_parallel.common import WIDTH, global_batch, local, strip

__all__ = ["HONOURED", "REFUSED", "SCENARIOS"]

STEPS = 3


class Scaled(nn.Module):
    """A buffer read by forward and never written by it: only the broadcast keeps it equal."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def reset_parameters(self) -> None:
        self.scale.fill_(0.5)


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.Tanh(), Scaled(WIDTH), nn.Linear(WIDTH, 4), nn.Linear(4, 1)
    )
    model[4].weight.requires_grad_(False)  # frozen before wrapping: never reduced
    return model


def _reset_all(model: nn.Module) -> None:
    torch.manual_seed(3)
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset) and not isinstance(module, nn.Sequential):
            reset()


def _inner(model: nn.Module) -> nn.Sequential:
    return model.module if isinstance(model, cadence.DataParallel) else model


# Honoured: name -> method(model). The model is the wrapper (or the plain model).
HONOURED: dict[str, Callable[[nn.Module], object]] = {
    "to_empty": lambda m: (m.to_empty(device="cpu"), _reset_all(m)),
    "cpu": lambda m: m.cpu(),
    "to_cpu": lambda m: m.to("cpu"),
    "float": lambda m: m.float(),
    "apply_clone": lambda m: m._apply(lambda t: t.clone()),
    "submodule_apply_clone": lambda m: _inner(m)[2]._apply(lambda t: t.clone()),
    "submodule_to_empty": lambda m: (_inner(m).to_empty(device="cpu"), _reset_all(m)),
}

# Refused: name -> (method(dp), where it is refused, message fragments). ``call``:
# the method itself raises; ``step``: the next training step does (the change was
# made on the inner module, where the wrapper does not see it happen).
REFUSED: dict[str, tuple[Callable[[cadence.DataParallel], object], str, tuple[str, ...]]] = {
    "to_float64": (lambda m: m.to(torch.float64), "call", ("to()", "float64", "Fix")),
    "double": (lambda m: m.double(), "call", ("double()", "float64", "Fix")),
    "half": (lambda m: m.half(), "call", ("half()", "float16", "Fix")),
    "bfloat16": (lambda m: m.bfloat16(), "call", ("bfloat16()", "bfloat16", "Fix")),
    "to_empty_cuda": (lambda m: m.to_empty(device="cuda"), "call", ("to_empty()", "cuda", "Fix")),
    "load_state_dict_assign": (
        lambda m: m.load_state_dict(m.state_dict(), assign=True),
        "call",
        ("load_state_dict(assign=True)", "Fix"),
    ),
    "submodule_assign": (
        lambda m: m.module.load_state_dict(m.module.state_dict(), assign=True),
        "step",
        ("0.weight", "replaced", "Fix"),
    ),
    "submodule_double": (lambda m: m.module.double(), "step", ("0.weight", "float64", "Fix")),
    "requires_grad_false": (
        lambda m: m.module[0].requires_grad_(False),
        "step",
        ("0.weight", "requires_grad", "Fix"),
    ),
    "requires_grad_true": (
        lambda m: m.module[4].requires_grad_(True),
        "step",
        ("4.weight", "requires_grad", "Fix"),
    ),
}


def _steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    rank, world = (
        (0, 1)
        if not isinstance(model, cadence.DataParallel)
        else (
            dist.get_rank(),
            dist.get_world_size(),
        )
    )
    dtype = _inner(model)[0].weight.dtype
    losses = []
    for step in steps:
        x, y = global_batch(step, dist.get_world_size())
        x, y = local(x, rank, world).to(dtype), local(y, rank, world).to(dtype)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = strip(model.state_dict())
    return {k: v.detach().clone() for k, v in sd.items()}


def _spread(model: nn.Module) -> float:
    """Largest difference between the ranks' parameters and buffers."""
    worst = 0.0
    for t in _state(model).values():
        if not t.is_floating_point():
            continue
        everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, t.contiguous())
        worst = max(worst, max_abs_diff(everyone[0], everyone[-1]))
    return worst


def honoured(method: str, order: str) -> None:
    """The method on the wrapper, rank 1's buffer drifted, then training vs one process.

    Training matches one process on the global batch (from the values the method left),
    and parameters and buffers are equal on every rank.
    """
    after_a_step = order == "after_a_step"
    rank = dist.get_rank()
    dp = cadence.DataParallel(make_model())
    opt = torch.optim.SGD([p for p in dp.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    if after_a_step:
        _steps(dp, opt, range(1))
    HONOURED[method](dp)
    start = _state(dp)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, start)
    start = everyone[0]  # rank 0's values: the broadcast makes them everyone's
    if rank == 1:
        dp.module[2].scale.fill_(2.0)  # a rank-local change the next forward must undo
    losses = _steps(dp, opt, range(1, STEPS + 1))
    ref = make_model()
    ref_opt = torch.optim.SGD(
        [p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9
    )
    if after_a_step:
        _steps(ref, ref_opt, range(1))
    HONOURED[method](ref)
    ref.load_state_dict(start)
    _steps(ref, ref_opt, range(1, STEPS + 1))
    assert losses[0] != losses[-1], f"it does not train: losses {losses}"
    vs_single = max_abs_diff(_state(dp), _state(ref))
    assert vs_single <= TOL, f"differs from one process by {vs_single:.3e}"
    spread = _spread(dp)
    assert spread == 0.0, f"parameters or buffers differ across ranks by {spread}"


def _refused_setup() -> tuple[cadence.DataParallel, torch.optim.Optimizer]:
    dp = cadence.DataParallel(make_model())
    opt = torch.optim.SGD([p for p in dp.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    _steps(dp, opt, range(1))
    return dp, opt


def refused_before_anything_changes(method: str) -> None:
    """Refused by the call itself, naming the method and the fix; training then continues."""
    fn, where, fragments = REFUSED[method]
    assert where == "call", where
    dp, opt = _refused_setup()
    before = _state(dp)
    assert_raises(lambda: fn(dp), *fragments)
    after = _state(dp)
    assert max_abs_diff(after, before) == 0.0, "values changed"
    dtypes = {k: (str(before[k].dtype), str(v.dtype)) for k, v in after.items()}
    assert all(a == b for a, b in dtypes.values()), f"dtypes changed: {dtypes}"
    # Nothing changed, so training simply continues.
    _steps(dp, opt, range(1, STEPS))
    spread = _spread(dp)
    assert spread == 0.0, f"parameters or buffers differ across ranks by {spread}"


def refused_by_the_next_step(method: str) -> None:
    """A change on the inner module: the next step raises, naming the parameter and the fix."""
    fn, where, fragments = REFUSED[method]
    assert where == "step", where
    dp, opt = _refused_setup()
    fn(dp)
    assert_raises(lambda: _steps(dp, opt, range(1, 2)), *fragments)


def not_a_torch_ddp_instance() -> None:
    from torch.nn.parallel import DistributedDataParallel

    dp = cadence.DataParallel(make_model())
    assert not isinstance(dp, DistributedDataParallel), "a DistributedDataParallel instance"


TOL = 1e-6

SCENARIOS = [
    *(
        Scenario(f"honoured-{method}-{order}", honoured, {"method": method, "order": order})
        for method in HONOURED
        for order in ("before_training", "after_a_step")
    ),
    *cases(
        refused_before_anything_changes,
        "method",
        [m for m, (_, where, _) in REFUSED.items() if where == "call"],
    ),
    *cases(
        refused_by_the_next_step,
        "method",
        [m for m, (_, where, _) in REFUSED.items() if where == "step"],
    ),
    *scenarios(not_a_torch_ddp_instance),
]
