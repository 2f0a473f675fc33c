"""Scenarios: the runtime behaviours torch's own FSDP2 tests check, with parity against FSDP2.

torch's ``test/distributed/_composable/fsdp/test_fully_shard_training.py``,
``test_fully_shard_autograd.py`` and ``test_fully_shard_comm.py`` check, on gloo and
CPU or in behaviours that do not depend on the device: a unit called twice in one
forward, two forwards before one backward (DPO-style) with nested units and activation
checkpointing, a child unit run outside the root's forward, unused forward outputs and
unused modules, non-tensor containers between units, recovery after an exception in
forward, ``unshard()`` before the first forward, roots that take no inputs or own no
parameters, and world size 1. Each scenario runs the same steps under
`cadence.fully_shard` and torch's ``fully_shard`` on the same model, batches and
seeds, and compares losses, ``full_tensor()`` gradients (``None`` included),
parameters and, where stated, all-gather/reduce-scatter counts (cadence's from its
event log, FSDP2's by wrapping ``torch.distributed``'s functions). Each scenario's
docstring names the torch test it ports. `SCENARIOS` runs in one world-2 launch,
`SCENARIOS_WS1` in one world-1 launch.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import cadence
from cadence.fsdp import fully_shard
from cadence.testing import max_abs_diff
from tests._scenarios import cases, scenarios
from tests.fsdp.bodies_parity import _Counter
from tests.fsdp.common import full_params

STEPS = 3
DIM = 8

Shard = Callable[[nn.Module, bool | None], None]
"""Shards one module in place: ``(module, reshard_after_forward)``."""


# -- comparison helpers --------------------------------------------------------------


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Gradients by name as full tensors (a collective for DTensors: call on every rank)."""
    out: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g)
    return out


def _same(what: str, got: dict[str, Any], want: dict[str, Any], tol: float = 1e-6) -> None:
    """Same names, the same ``None`` entries, values within ``tol``."""
    rank = dist.get_rank()
    assert set(got) == set(want), f"rank {rank} {what}: names {sorted(got)} vs {sorted(want)}"
    nones = sorted(n for n in got if (got[n] is None) != (want[n] is None))
    assert not nones, (
        f"rank {rank} {what}: None (cadence, FSDP2) differs for "
        f"{[(n, got[n] is None, want[n] is None) for n in nones]}"
    )
    present = {n: v for n, v in got.items() if v is not None}
    diff = max_abs_diff(present, {n: want[n] for n in present})
    assert diff < tol, f"rank {rank} {what}: max difference {diff:.3e} (tolerance {tol})"


def _same_loss(what: str, got: float, want: float, tol: float = 1e-6) -> None:
    rank = dist.get_rank()
    assert abs(got - want) < tol, f"rank {rank} {what}: loss {got!r} (cadence) vs {want!r} (FSDP2)"


def _same_counts(what: str, got: tuple[int, int], want: tuple[int, int]) -> None:
    rank = dist.get_rank()
    assert got == want, (
        f"rank {rank} {what}: (all-gathers, reduce-scatters) {got} (cadence) vs {want} (FSDP2)"
    )


def _mesh() -> Any:
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _cadence(log: cadence.EventLog) -> Shard:
    return lambda m, raf: fully_shard(m, reshard_after_forward=raf, event_log=log) and None


def _torch(mesh: Any) -> Shard:
    def shard(m: nn.Module, raf: bool | None) -> None:
        torch_fully_shard(m, mesh=mesh, reshard_after_forward=raf)

    return shard


class _Pair:
    """One model twice: ``ours`` under cadence's fully_shard, ``theirs`` under FSDP2's.

    ``apply(model, shard)`` calls ``shard`` on the units bottom-up, root last; counts
    are (all-gathers, reduce-scatters) since the last `counts` call.
    """

    def __init__(self, model: nn.Module, apply: Callable[[nn.Module, Shard], None]) -> None:
        self.log = cadence.EventLog()
        self.ours, self.theirs = copy.deepcopy(model), copy.deepcopy(model)
        apply(self.ours, _cadence(self.log))
        apply(self.theirs, _torch(_mesh()))
        self.counter = _Counter(fsdp2_only=True).__enter__()

    def __enter__(self) -> _Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.counter.__exit__()

    def counts(self) -> tuple[tuple[int, int], tuple[int, int]]:
        ours = (self.log.count("all_gather"), self.log.count("reduce_scatter"))
        self.log.clear()
        return ours, self.counter.take()

    def backward(self, what: str, loss_of: Callable[[nn.Module], torch.Tensor]) -> None:
        """``loss_of(model).backward()`` on each model in turn; the losses must agree."""
        losses = []
        for m in (self.ours, self.theirs):
            loss = loss_of(m)
            loss.backward()
            losses.append(float(loss.detach()))
        _same_loss(what, *losses)

    def check(self, what: str, *, grads: bool = True, tol: float = 1e-6) -> None:
        if grads:
            _same(f"{what} grads", _full_grads(self.ours), _full_grads(self.theirs), tol)
        _same(f"{what} params", full_params(self.ours), full_params(self.theirs), tol)


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.chunk(dist.get_world_size())[dist.get_rank()]


def _batch(step: int, rows: int = 4, dim: int = DIM, seed: int = 0) -> torch.Tensor:
    """A global batch of ``rows`` per rank, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.rand(rows * dist.get_world_size(), dim, generator=g)


# -- 1. a unit called twice in one forward; two forwards before one backward ---------------


class _MultiForward(nn.Module):
    """torch's ``MultiForwardModule``: ``inner`` (a unit) runs twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inner = nn.Linear(DIM, DIM)
        self.outer = nn.Linear(DIM, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = self.inner(x)
        j = self.inner(x)
        return self.outer(i + j)


def a_unit_called_twice_in_one_forward_matches_fsdp2(raf: bool) -> None:
    """torch's ``test_multi_forward_module``: ``inner`` sharded with ``raf`` and called twice;
    losses, gradients, parameters and per-step collective counts equal FSDP2's."""

    def apply(m: nn.Module, shard: Shard) -> None:
        shard(m.inner, raf)
        shard(m, None)

    with _Pair(_MultiForward(), apply) as pair:
        opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (pair.ours, pair.theirs)]
        for step in range(STEPS):
            x = _local(_batch(step))
            pair.backward(f"step {step}", lambda m, x=x: m(x).sum())
            _same_counts(f"step {step}", *pair.counts())
            pair.check(f"raf={raf} step {step}")
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=step % 2 == 1)
        pair.check(f"raf={raf} end", grads=False)


class _FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 2 * DIM)
        self.w2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class _Layer(nn.Module):
    """An attention stand-in and a feed-forward, each a unit inside the layer's unit."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.ff = _FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.attn(x))
        return x + self.ff(self.norm(x))


class _Policy(nn.Module):
    """Two layers (three levels of units) and a scalar head; ``ac`` checkpoints each layer
    without reentrancy, as torch's nested-FSDP-and-checkpoint test."""

    def __init__(self, ac: bool) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.layers = nn.ModuleList(_Layer() for _ in range(2))
        self.head = nn.Linear(DIM, 1)
        self.ac = ac

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.ac else layer(x)
        return self.head(x).squeeze(-1)


def _shard_policy(m: nn.Module, shard: Shard) -> None:
    for layer in m.layers:
        shard(layer.attn, None)
        shard(layer.ff, None)
        shard(layer, None)
    shard(m, None)


def two_forwards_then_one_backward_match_fsdp2(ac: bool) -> None:
    """torch's ``_test_double_forward_with_nested_fsdp_and_checkpoint``, small: a chosen
    and a rejected forward (DPO), one backward of their preference loss; gradients,
    parameters and per-step collective counts equal FSDP2's, with and without
    non-reentrant activation checkpointing."""
    with _Pair(_Policy(ac), _shard_policy) as pair:
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pair.ours, pair.theirs)]
        for step in range(STEPS):
            chosen, rejected = _local(_batch(step, seed=1)), _local(_batch(step, seed=2))
            losses = []
            for m in (pair.ours, pair.theirs):
                margin = m(chosen) - m(rejected)
                loss = -nn.functional.logsigmoid(margin).mean()
                loss.backward()
                losses.append(float(loss.detach()))
            _same_loss(f"ac={ac} step {step}", *losses)
            ours, theirs = pair.counts()
            # The reduce-scatters are FSDP2's; cadence all-gathers less: a unit used by
            # both forwards is gathered once in backward (one post-backward per unit and
            # backward), where FSDP2 reshards and re-gathers between the two graphs'
            # backwards (23 all-gathers on torch 2.13 and 2.15). With checkpointing, a
            # layer unit's recompute gathers it once more after its post-backward.
            want = (20 if ac else 19, 7)
            assert ours == want and ours[1] == theirs[1] and ours[0] <= theirs[0], (
                f"rank {dist.get_rank()} ac={ac} step {step}: (all-gathers, reduce-scatters) "
                f"{ours} (cadence, want {want}) vs {theirs} (FSDP2)"
            )
            pair.check(f"ac={ac} step {step}")
            for o in opts:
                o.step()
                o.zero_grad()
        pair.check(f"ac={ac} end", grads=False)


# -- 2. a unit run outside the root's forward ------------------------------------------


def a_child_unit_runs_alone_after_a_root_step() -> None:
    """torch's ``test_non_root_forward_backward``: forward/backward through the root, a
    step, then forward/backward through a child unit alone, a step: losses, gradients
    and parameters equal FSDP2's each time."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM))

    def apply(m: nn.Module, shard: Shard) -> None:
        shard(m[0], None)
        shard(m[2], None)
        shard(m, None)

    with _Pair(model, apply) as pair:
        opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (pair.ours, pair.theirs)]
        for step in range(STEPS):
            x = _local(_batch(step))
            for part, run in (("root", lambda m, x: m(x)), ("child", lambda m, x: m[0](x))):
                pair.backward(f"step {step} {part}", lambda m, run=run, x=x: run(m, x).sum())
                pair.check(f"step {step} {part}")
                for o in opts:
                    o.step()
                    o.zero_grad()
        pair.check("end", grads=False)


# -- 3. unused forward outputs, unused modules, unused parameters ---------------------------


class _DoubleLinear(nn.Module):
    """torch's ``DoubleLinear``: two outputs, or one (``lin2`` unused)."""

    def __init__(self, use_second_linear: bool) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.lin1 = nn.Linear(DIM, DIM)
        self.lin2 = nn.Linear(DIM, DIM)
        self.use_second_linear = use_second_linear

    def forward(self, x: torch.Tensor) -> Any:
        if self.use_second_linear:
            return torch.relu(self.lin1(x)), torch.relu(self.lin2(x))
        return torch.relu(self.lin1(x))


def _train_double_linear(pair: _Pair, loss_of: Callable[[Any, int], torch.Tensor]) -> None:
    """torch's loop: Adam, ``zero_grad(set_to_none=step % 2)``; checks after each step."""
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (pair.ours, pair.theirs)]
    for step in range(6):
        x = _local(_batch(step, rows=2))
        pair.backward(f"step {step}", lambda m, x=x, step=step: loss_of(m(x), step))
        _same_counts(f"step {step}", *pair.counts())
        pair.check(f"step {step} before the step")
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=step % 2 == 1)
        pair.check(f"step {step} after the step")


def an_unused_forward_output_matches_fsdp2(raf: bool) -> None:
    """torch's ``_test_unused_forward_output``: the loss uses both outputs for 3 steps,
    then only the first; ``lin2`` (in the root unit) then gets no gradient, as FSDP2."""

    def apply(m: nn.Module, shard: Shard) -> None:
        shard(m.lin1, raf)
        shard(m, raf)

    with _Pair(_DoubleLinear(use_second_linear=True), apply) as pair:
        _train_double_linear(
            pair, lambda out, step: (out[0] * out[1]).sum() if step < 3 else out[0].sum()
        )


def an_unused_output_of_a_unit_matches_fsdp2(raf: bool) -> None:
    """As `an_unused_forward_output_matches_fsdp2`, with ``lin2`` a unit of its own: after
    step 3 its output is dropped, so with ``raf=False`` it stays unsharded through a
    backward that never reaches it while the optimizer steps its shards."""

    def apply(m: nn.Module, shard: Shard) -> None:
        shard(m.lin1, raf)
        shard(m.lin2, raf)
        shard(m, raf)

    with _Pair(_DoubleLinear(use_second_linear=True), apply) as pair:
        _train_double_linear(
            pair, lambda out, step: (out[0] * out[1]).sum() if step < 3 else out[0].sum()
        )


def an_unused_module_matches_fsdp2(raf: bool) -> None:
    """torch's ``_test_unused_forward_module``: ``lin2`` is a unit that never runs."""

    def apply(m: nn.Module, shard: Shard) -> None:
        shard(m.lin1, raf)
        shard(m.lin2, raf)
        shard(m, raf)

    with _Pair(_DoubleLinear(use_second_linear=False), apply) as pair:
        _train_double_linear(pair, lambda out, step: out.sum())


def an_unused_parameter_inside_a_used_unit_keeps_no_gradient(raf: bool) -> None:
    """Beyond torch's tests: ``lin1`` and ``lin2`` share the root unit and only ``lin1``'s
    output reaches the loss. FSDP2 reduces only the parameters that got a gradient, so
    ``lin2``'s stay ``None``; a zero gradient instead would let Adam move ``lin2``."""

    def apply(m: nn.Module, shard: Shard) -> None:
        shard(m, raf)

    with _Pair(_DoubleLinear(use_second_linear=True), apply) as pair:
        _train_double_linear(
            pair, lambda out, step: (out[0] * out[1]).sum() if step < 2 else out[0].sum()
        )


# -- 4. non-tensor activations between units --------------------------------------------


_NT = collections.namedtuple("_NT", "x y")


def _pack(kind: str, x: torch.Tensor) -> Any:
    if kind == "list":
        return [x]
    if kind == "namedtuple":
        return _NT(x, torch.ones_like(x))
    if kind == "tuple":
        return (x,)
    return {"x": x}


def _unpack(kind: str, inp: Any) -> torch.Tensor:
    return inp["x"] if kind == "dict" else inp[0]


class _ContainerBlock(nn.Module):
    """Takes and returns ``kind`` containers around its activation (torch's ``Module``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin1 = nn.Linear(DIM, DIM)
        self.lin2 = nn.Linear(DIM, DIM)

    def forward(self, inp: Any) -> Any:
        x = torch.relu(self.lin2(torch.relu(self.lin1(_unpack(self.kind, inp)))))
        if self.kind == "namedtuple":
            return _NT(x, *list(inp[1:]))
        return _pack(self.kind, x)


class _Containers(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.kind = kind
        self.blocks = nn.ModuleList(_ContainerBlock(kind) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _pack(self.kind, x)
        for b in self.blocks:
            h = b(h)
        return _unpack(self.kind, h)


def non_tensor_activations_match_fsdp2(kind: str) -> None:
    """torch's ``test_nontensor_activations``: units pass their activation inside a list,
    namedtuple, tuple or dict; gradients reach every unit, as under FSDP2."""

    def apply(m: nn.Module, shard: Shard) -> None:
        for b in m.blocks:
            shard(b, None)
        shard(m, None)

    with _Pair(_Containers(kind), apply) as pair:
        opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (pair.ours, pair.theirs)]
        for step in range(STEPS):
            x = _local(_batch(step, rows=2))
            pair.backward(f"{kind} step {step}", lambda m, x=x: m(x).sum())
            _same_counts(f"{kind} step {step}", *pair.counts())
            pair.check(f"{kind} step {step}")
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=step % 2 == 1)


# -- 5. reset after an exception in forward ------------------------------------------------


class _Fails(nn.Module):
    """A layer that raises in forward while ``fail`` is set (after its unit all-gathered)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("injected failure in forward")
        return torch.relu(self.lin(x))


class _WithFailing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.blocks = nn.ModuleList(_Fails() for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def reset_after_an_exception_in_forward_matches_fsdp2() -> None:
    """torch's ``test_reset_iter_state_after_exception`` (ungrouped): the middle unit
    raises mid-forward, ``reset_iter_state()`` (the same name on both), and the next
    steps' gradients, parameters and collective counts equal FSDP2's."""

    def apply(m: nn.Module, shard: Shard) -> None:
        for b in m.blocks:
            shard(b, None)
        shard(m, None)

    with _Pair(_WithFailing(), apply) as pair:
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pair.ours, pair.theirs)]
        x = _local(_batch(0))
        for m in (pair.ours, pair.theirs):
            m.blocks[1].fail = True
            try:
                m(x).sum().backward()
            except ValueError:
                pass
            else:
                raise AssertionError("the injected failure did not raise")
            m.blocks[1].fail = False
            m.reset_iter_state()
        pair.counts()  # the aborted forward's collectives are not compared
        for step in range(1, STEPS + 1):
            x = _local(_batch(step))
            pair.backward(f"step {step}", lambda m, x=x: m(x).sum())
            _same_counts(f"step {step}", *pair.counts())
            pair.check(f"step {step}")
            for o in opts:
                o.step()
                o.zero_grad()


# -- 6. unshard before the first forward; roots without inputs or parameters -----------------


def unshard_before_the_first_forward_matches_fsdp2() -> None:
    """torch's ``test_unshard_without_lazy_init``: ``unshard()`` before any forward shows the
    full original values; ``reshard()`` then a step matches FSDP2."""
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(DIM, 6), nn.ReLU(), nn.Linear(6, 3))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}

    def apply(m: nn.Module, shard: Shard) -> None:
        shard(m[0], None)
        shard(m, None)

    pair = _Pair(model, apply)
    rank = dist.get_rank()
    try:
        for name, m in (("cadence", pair.ours), ("FSDP2", pair.theirs)):
            m.unshard()
            m[0].unshard()
            seen = {n: p.detach().clone() for n, p in m.named_parameters()}
            kinds = sorted({type(p).__name__ for p in m.parameters()})
            assert "DTensor" not in kinds, f"rank {rank} {name}: unsharded params are {kinds}"
            diff = max_abs_diff(seen, full)
            assert diff == 0.0, f"rank {rank} {name}: unsharded params differ by {diff:.3e}"
            m[0].reshard()
            m.reshard()
        pair.counts()
        x = _local(_batch(0))
        pair.backward("after unshard/reshard", lambda m, x=x: m(x).sum())
        pair.check("after unshard/reshard")
    finally:
        pair.close()


class _NoInputs(nn.Module):
    """A root whose forward takes no inputs (its input is a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(9)
        self.register_buffer("inp", torch.rand(4, DIM))
        self.lin = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, 1)

    def forward(self) -> torch.Tensor:
        return self.out(torch.relu(self.lin(self.inp)))


def a_root_without_forward_inputs_matches_fsdp2() -> None:
    """torch's ``test_root_no_forward_inputs``: ``model()`` trains as under FSDP2."""

    def apply(m: nn.Module, shard: Shard) -> None:
        shard(m.lin, None)
        shard(m, None)

    with _Pair(_NoInputs(), apply) as pair:
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pair.ours, pair.theirs)]
        for step in range(STEPS):
            pair.backward(f"step {step}", lambda m: m().sum())
            _same_counts(f"step {step}", *pair.counts())
            pair.check(f"step {step}")
            for o in opts:
                o.step()
                o.zero_grad()


class _ParamlessRoot(nn.Module):
    """torch's ``ParamlessModule`` root: owns no parameters, takes ``(x, (y1, y2))``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(10)
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, ys: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        y1, y2 = ys
        return self.b(torch.relu(self.a(x + y1))) * y2


def a_parameterless_root_unit_matches_fsdp2() -> None:
    """torch's ``test_root_move_forward_input_to_device`` and ``test_unshard_no_param_group``:
    a root unit that owns no parameters takes nested inputs and trains as under FSDP2;
    ``unshard(async_op=True).wait()`` on it does nothing and raises nothing."""

    def apply(m: nn.Module, shard: Shard) -> None:
        shard(m.a, None)
        shard(m.b, None)
        shard(m, None)

    with _Pair(_ParamlessRoot(), apply) as pair:
        for m in (pair.ours, pair.theirs):
            handle = m.unshard(async_op=True)
            if handle is not None:
                handle.wait()
            m.reshard()
        _same_counts("unshard of a parameterless root", *pair.counts())
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pair.ours, pair.theirs)]
        for step in range(STEPS):
            x, y1, y2 = (_local(_batch(step, seed=s)) for s in (3, 4, 5))
            pair.backward(f"step {step}", lambda m, x=x, y=(y1, y2): m(x, y).sum())
            _same_counts(f"step {step}", *pair.counts())
            pair.check(f"step {step}")
            for o in opts:
                o.step()
                o.zero_grad()


SCENARIOS = [
    *cases(a_unit_called_twice_in_one_forward_matches_fsdp2, "raf", [True, False]),
    *cases(two_forwards_then_one_backward_match_fsdp2, "ac", [False, True]),
    *scenarios(a_child_unit_runs_alone_after_a_root_step),
    *cases(an_unused_forward_output_matches_fsdp2, "raf", [True, False]),
    *cases(an_unused_output_of_a_unit_matches_fsdp2, "raf", [True, False]),
    *cases(an_unused_module_matches_fsdp2, "raf", [True, False]),
    *cases(an_unused_parameter_inside_a_used_unit_keeps_no_gradient, "raf", [True, False]),
    *cases(non_tensor_activations_match_fsdp2, "kind", ["list", "namedtuple", "tuple", "dict"]),
    *scenarios(
        reset_after_an_exception_in_forward_matches_fsdp2,
        unshard_before_the_first_forward_matches_fsdp2,
        a_root_without_forward_inputs_matches_fsdp2,
        a_parameterless_root_unit_matches_fsdp2,
    ),
]


# -- 7. world size 1 ---------------------------------------------------------------------


class _Counts(NamedTuple):
    ours: tuple[int, int]
    theirs: tuple[int, int]


def world_size_1_matches_fsdp2() -> None:
    """torch's ``test_train_parity_single_worldsize1`` / ``test_size1_reduceop``: at world 1
    cadence trains as FSDP2 (parameters after 3 steps) and, like FSDP2, issues no
    all-gather or reduce-scatter (one rank holds every row already)."""
    assert dist.get_world_size() == 1, dist.get_world_size()
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(DIM, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 1))

    def apply(m: nn.Module, shard: Shard) -> None:
        shard(m[0], None)
        shard(m[2], None)
        shard(m, None)

    pair = _Pair(model, apply)
    ref = copy.deepcopy(model)
    try:
        opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (pair.ours, pair.theirs, ref)]
        for step in range(STEPS):
            x = _batch(step)
            losses = []
            for m in (pair.ours, pair.theirs, ref):
                loss = m(x).pow(2).mean()
                loss.backward()
                losses.append(float(loss.detach()))
            _same_loss(f"step {step}", losses[0], losses[1])
            counts = _Counts(*pair.counts())
            _same_counts(f"step {step}", counts.ours, counts.theirs)
            pair.check(f"step {step}")
            for o in opts:
                o.step()
                o.zero_grad()
        _same("params vs one process", full_params(pair.ours), full_params(ref))
    finally:
        pair.close()


SCENARIOS_WS1 = scenarios(world_size_1_matches_fsdp2)
