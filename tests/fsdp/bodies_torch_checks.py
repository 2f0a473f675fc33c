"""Scenarios: the checks and policies torch's own FSDP2 tests pin, with parity against FSDP2.

torch's ``test/distributed/_composable/fsdp/`` tests (``test_fully_shard_init.py``,
``_state.py``, ``_training.py``, ``_grad_timing/autograd.py``) and the 2.15 ``MixedPrecisionPolicy``
source check: the reduce dtype when ``reduce_dtype`` is unset (changed in torch 2.15),
the list form ``fully_shard([a, b])``, post-accumulate-grad hooks on the sharded
parameters (optimizer in backward), containers without ``forward``, 0-dim parameters,
``copy.deepcopy``, parameters tied between sibling units, and no false tie when
parameter ids are reused after ``gc.collect()``. Each scenario runs the same steps under
`cadence.fully_shard` and torch's ``fully_shard`` on the same model, batches and seeds,
and compares losses, gradients and parameters, or the error's type (cadence's refusals
are ``FullyShardError``s, ``ValueError``s where FSDP2 raises ``ValueError``). The list,
with each torch test's scenario, is in ``/tmp/fsdp_doc_checks.md`` (for ``docs/``).
`SCENARIOS` runs in one world-2 launch.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import cadence
from cadence.fsdp import FullyShardError, FullyShardValueError, fully_shard
from cadence.fsdp._mp_rules import REDUCE_DEFAULTS_TO_ORIG_DTYPE
from cadence.testing import max_abs_diff
from tests._scenarios import assert_raises, cases, scenarios
from tests.fsdp.common import (
    apply_cadence,
    apply_torch,
    full_params,
    loss_fn,
    make_batches,
    make_blocks,
    train_steps,
)

STEPS = 3


def _same(what: str, got: dict[str, Any], want: dict[str, Any], tol: float = 1e-6) -> None:
    rank = dist.get_rank()
    assert set(got) == set(want), f"rank {rank} {what}: names {sorted(got)} vs {sorted(want)}"
    diff = max_abs_diff(got, want)
    assert diff <= tol, f"rank {rank} {what}: max difference {diff:.3e} (tolerance {tol})"


def _mesh() -> Any:
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _untouched(module: nn.Module, cls: type, what: str) -> None:
    """A refused fully_shard left ``module`` as it was: its class, plain parameters."""
    rank = dist.get_rank()
    assert type(module) is cls, f"rank {rank} {what}: class became {type(module).__name__}"
    sharded = [n for n, p in module.named_parameters() if isinstance(p, DTensor)]
    assert not sharded, f"rank {rank} {what}: parameters {sharded} were sharded anyway"


# -- the reduce dtype when reduce_dtype is unset (torch 2.15's change) --------------------


@contextmanager
def _torch_reduce_dtypes() -> Iterator[set[str]]:
    """The input dtypes of the reduce-scatters torch's fully_shard issues (looked up late)."""
    seen: set[str] = set()
    name = "reduce_scatter_single"  # what FSDP2 calls, 2.13 and 2.15 alike
    orig = getattr(dist, name)

    def spy(output: torch.Tensor, input: torch.Tensor, *a: Any, **k: Any) -> Any:
        seen.add(str(input.dtype).removeprefix("torch."))
        return orig(output, input, *a, **k)

    setattr(dist, name, spy)
    try:
        yield seen
    finally:
        setattr(dist, name, orig)


def an_unset_reduce_dtype_reduces_as_the_installed_fsdp2(policy: str) -> None:
    """``param_dtype=bf16``, ``reduce_dtype`` unset: same wire dtype and params as FSDP2.

    torch 2.15 reduces (and accumulates) in the parameter's dtype (fp32), earlier torch in
    ``param_dtype`` (bf16); cadence follows the installed torch, with torch's policy and
    with its own.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches("blocks", STEPS, 8)
    theirs = make_blocks()
    apply_torch(theirs, theirs.units(), mp_policy=TorchMP(param_dtype=torch.bfloat16))
    with _torch_reduce_dtypes() as torch_wire:
        want_losses = train_steps(theirs, batches, rank, world)
    ours = make_blocks()
    log = cadence.EventLog()
    mp: Any = (
        TorchMP(param_dtype=torch.bfloat16)
        if policy == "torch"
        else cadence.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    )
    apply_cadence(ours, ours.units(), mp_policy=mp, event_log=log)
    got_losses = train_steps(ours, batches, rank, world)
    wire = {e.dtype for e in log.collectives() if e.kind == "reduce_scatter"}
    expected = "float32" if REDUCE_DEFAULTS_TO_ORIG_DTYPE else "bfloat16"
    assert torch_wire == {expected}, (
        f"rank {rank}: FSDP2 {torch.__version__} reduced in {torch_wire}, cadence expected "
        f"{expected} (REDUCE_DEFAULTS_TO_ORIG_DTYPE={REDUCE_DEFAULTS_TO_ORIG_DTYPE})"
    )
    assert wire == torch_wire, f"rank {rank} {policy} policy: cadence {wire}, FSDP2 {torch_wire}"
    assert got_losses == want_losses, f"rank {rank}: losses {got_losses} vs {want_losses}"
    _same(f"{policy} policy params after {STEPS} steps", full_params(ours), full_params(theirs))


def a_policy_field_cadence_cannot_honour_is_refused_by_name() -> None:
    """torch 2.15's ``param_dtype_override_fn`` is refused by name, never dropped."""
    names = {f.name for f in dataclasses.fields(TorchMP)}
    if "param_dtype_override_fn" not in names:  # torch < 2.15: the field does not exist
        return
    policy = TorchMP(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: None)
    m = make_blocks()
    assert_raises(
        lambda: fully_shard(m, mp_policy=policy),
        "param_dtype_override_fn",
        "separate unit",
        kind=FullyShardError,
    )
    _untouched(m, type(make_blocks()), "param_dtype_override_fn refused")
    # Unset, the field is no obstacle.
    fully_shard(make_blocks(), mp_policy=TorchMP(param_dtype=torch.bfloat16))


# -- the list form ---------------------------------------------------------------------


def a_list_of_modules_is_refused_naming_the_fix(form: str) -> None:
    """FSDP2's ``fully_shard([a, b])`` (one group): refused before anything changes."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    modules: Any = [a, b] if form == "list" else (a, b)
    assert_raises(
        lambda: fully_shard(modules),
        f"got a {form} of modules",
        "fully_shard([a, b])",
        "common parent",
        kind=FullyShardError,
    )
    _untouched(a, nn.Linear, f"{form}[0]")
    _untouched(b, nn.Linear, f"{form}[1]")
    # torch accepts the same call (cadence refuses a form FSDP2 has, not a misuse).
    grouped = torch_fully_shard([nn.Linear(4, 4), nn.Linear(4, 4)], mesh=_mesh())
    assert isinstance(grouped, list), f"rank {dist.get_rank()}: FSDP2 gave {type(grouped)}"


# -- post-accumulate-grad hooks on the sharded parameters ---------------------------------


def _hooked(lib: str) -> tuple[nn.Module, dict[str, list[torch.Tensor]]]:
    """Blocks sharded per block and at the root; every parameter records its hook calls."""
    m = make_blocks()
    (apply_torch if lib == "torch" else apply_cadence)(m, m.units())
    fired: dict[str, list[torch.Tensor]] = {n: [] for n, _ in m.named_parameters()}
    for name, p in m.named_parameters():

        def hook(param: torch.Tensor, name: str = name) -> None:
            grad = param.grad
            assert isinstance(grad, DTensor), f"{name}: grad {type(grad).__name__} in the hook"
            fired[name].append(grad.to_local().detach().clone())

        p.register_post_accumulate_grad_hook(hook)
    return m, fired


def post_accumulate_grad_hooks_fire_once_per_synced_backward() -> None:
    """Each sharded parameter's hook fires once per syncing backward, with FSDP2's grad.

    Two steps; the second accumulates one no-sync microbatch first (no hook then, as
    FSDP2: nothing is reduced).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [b.chunk(world)[rank] for b in make_batches("blocks", 2, 8)]
    runs = {}
    for lib in ("torch", "cadence"):
        m, fired = _hooked(lib)
        loss_fn(m, batches[0]).backward()
        m.set_requires_gradient_sync(False)  # type: ignore[operator]  # FSDPModule or cadence's
        loss_fn(m, batches[1][:2]).backward()
        m.set_requires_gradient_sync(True)  # type: ignore[operator]
        loss_fn(m, batches[1][2:]).backward()
        runs[lib] = fired
    for name, calls in runs["cadence"].items():
        want = runs["torch"][name]
        assert len(calls) == len(want) == 2, (
            f"rank {rank} {name}: hook fired {len(calls)} times, FSDP2 {len(want)} (expected 2)"
        )
        for i, (g, w) in enumerate(zip(calls, want)):
            diff = float((g - w).abs().max()) if g.numel() else 0.0
            assert g.shape == w.shape and diff <= 1e-6, (
                f"rank {rank} {name} call {i}: local grad {tuple(g.shape)} vs FSDP2 "
                f"{tuple(w.shape)}, max difference {diff:.3e}"
            )


def optimizer_in_backward_matches_fsdp2() -> None:
    """torch's ``test_post_acc_grad_hook_optim_parity``: per-parameter AdamW in the hooks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches("blocks", STEPS, 8)
    losses: dict[str, list[float]] = {}
    params = {}
    for lib in ("torch", "cadence"):
        m = make_blocks()
        (apply_torch if lib == "torch" else apply_cadence)(m, m.units())
        for p in m.parameters():
            opt = torch.optim.AdamW([p], lr=1e-2)

            def step(param: torch.Tensor, opt: torch.optim.Optimizer = opt) -> None:
                opt.step()
                opt.zero_grad()

            p.register_post_accumulate_grad_hook(step)
        losses[lib] = []
        for b in batches:
            loss = loss_fn(m, b.chunk(world)[rank])
            loss.backward()  # every parameter steps inside; nothing to do after
            losses[lib].append(loss.item())
            left = [n for n, p in m.named_parameters() if p.grad is not None]
            assert not left, f"rank {rank} {lib}: {left} kept a grad after their hook's step"
        params[lib] = full_params(m)
    assert losses["cadence"] == losses["torch"], (
        f"rank {rank}: losses {losses['cadence']} vs FSDP2 {losses['torch']}"
    )
    _same(f"params after {STEPS} optimizer-in-backward steps", params["cadence"], params["torch"])


# -- module-class checks ----------------------------------------------------------------


def _container(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "ModuleList":
        return nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    return nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})


class _RunList(nn.ModuleList):
    """A ModuleList that runs its modules: it has a forward, so both libraries accept it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self:
            x = m(x)
        return x


def a_container_without_forward_is_refused_as_fsdp2(kind: str) -> None:
    """``nn.ModuleList``/``nn.ModuleDict``: ValueError under both libraries."""
    rank = dist.get_rank()
    assert_raises(
        lambda: torch_fully_shard(_container(kind), mesh=_mesh()),
        "do not implement forward",
        kind=ValueError,
    )
    m = _container(kind)
    err = assert_raises(
        lambda: fully_shard(m), "do not implement forward", kind, kind=FullyShardValueError
    )
    assert isinstance(err, ValueError), f"rank {rank}: {type(err).__mro__} is no ValueError"
    _untouched(m, type(_container(kind)), kind)
    # A container subclass that implements forward is accepted, and trains.
    ok = fully_shard(_RunList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    ok(torch.randn(2, 4)).sum().backward()


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def a_0dim_parameter_is_refused_as_fsdp2() -> None:
    """torch's ``test_raise_scalar_parameter``: ValueError naming the parameter and the fix."""
    assert_raises(
        lambda: torch_fully_shard(_Scalar(), mesh=_mesh()), "scalar parameters", kind=ValueError
    )
    m = _Scalar()
    assert_raises(
        lambda: fully_shard(m), "'scale'", "0-dimensional", "shape (1,)", kind=FullyShardValueError
    )
    _untouched(m, _Scalar, "0-dim parameter refused")


def deepcopy_of_a_sharded_module_is_refused_as_fsdp2() -> None:
    """torch's ``test_fully_shard_deepcopy``: refused (FSDP2: AssertionError), model intact."""
    rank, world = dist.get_rank(), dist.get_world_size()
    theirs = make_blocks()
    apply_torch(theirs, theirs.units())
    assert_raises(lambda: copy.deepcopy(theirs), "does not support deepcopy", kind=AssertionError)
    ours = make_blocks()
    apply_cadence(ours, ours.units())
    assert_raises(
        lambda: copy.deepcopy(ours), "copy.deepcopy", "state_dict()", kind=FullyShardError
    )
    # A plain parent holding a sharded unit is refused the same way.
    holder = nn.Sequential(ours)
    assert_raises(lambda: copy.deepcopy(holder), "copy.deepcopy", kind=FullyShardError)
    # The refusal changed nothing: both still train alike.
    batches = make_batches("blocks", 2, 8)
    got, want = train_steps(ours, batches, rank, world), train_steps(theirs, batches, rank, world)
    assert got == want, f"rank {rank}: losses after the refused deepcopy {got} vs {want}"
    _same("params after the refused deepcopy", full_params(ours), full_params(theirs))


# -- ties between sibling units, and reused ids -----------------------------------------


class _TiedSiblings(nn.Module):
    """An embedding and an output projection sharing one weight, as two sibling modules."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(8, 4)
        self.out = nn.Linear(4, 8, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx))


def siblings_sharing_a_parameter_are_refused(when: str) -> None:
    """torch's ``test_shared_params_separate_fsdp_groups_error``: never trained untied.

    FSDP2 raises ValueError ("already managed by another FSDP group") at the first
    forward; cadence raises its ValueError at the second sibling's fully_shard, before
    anything changes. ``when="tied_after"``: the tie is made after the first sibling is
    sharded (the head then holds the sharded parameter itself).
    """
    rank = dist.get_rank()
    idx = torch.tensor([[1, 2, 3]])
    if when == "tied_before":
        theirs = _TiedSiblings()
        for part in (theirs.emb, theirs.out, theirs):
            torch_fully_shard(part, mesh=_mesh())
        assert_raises(lambda: theirs(idx), "already managed by another", kind=ValueError)
    ours = _TiedSiblings()
    fully_shard(ours.emb)
    if when == "tied_after":
        ours.out.weight = ours.emb.weight
    held = ours.out.weight
    err = assert_raises(
        lambda: fully_shard(ours.out),
        "'weight' is tied",
        "FullyShardEmbedding",
        "sibling",
        "common parent",
        kind=FullyShardValueError,
    )
    assert isinstance(err, ValueError), f"rank {rank}: {type(err).__mro__} is no ValueError"
    _untouched(ours.out, nn.Linear, "tied sibling refused") if when == "tied_before" else None
    assert ours.out.weight is held, f"rank {rank}: the refused call replaced out.weight"
    # The same model sharded at the common parent trains, tied, like FSDP2.
    m, ref = _TiedSiblings(), _TiedSiblings()
    fully_shard(m)
    torch_fully_shard(ref, mesh=_mesh())
    for model in (m, ref):
        model(idx).float().pow(2).mean().backward()
    assert m.out.weight is m.emb.weight, f"rank {rank}: the tie broke under the common parent"
    grads = {
        lib: {"w": model.emb.weight.grad.full_tensor()}  # type: ignore[union-attr]
        for lib, model in (("cadence", m), ("torch", ref))
    }
    _same("tied weight grad (parent unit)", grads["cadence"], grads["torch"])


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        self.head: nn.Linear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        assert self.head is not None
        return self.head(x)


def _layer_by_layer(shard: Callable[[nn.Module], Any]) -> tuple[_Stack, bool]:
    """Build and shard block by block, freeing each original (``gc.collect()``) on the way.

    Then a root-owned head is created after the GC until one of its parameters reuses
    the id of a freed original (returned: whether that happened), and the root is sharded.
    """
    torch.manual_seed(0)
    model = _Stack()
    freed: set[int] = set()
    for _ in range(4):
        layer = nn.Linear(8, 8)
        freed |= {id(p) for p in layer.parameters()}
        shard(layer)  # replaces the originals, which nothing else holds
        model.layers.append(layer)
        gc.collect()
    torch.manual_seed(1)
    model.head = nn.Linear(8, 1)
    # CPython hands freed object slots out again; the misses are kept alive meanwhile so
    # that each new candidate takes another slot, until one lands on a freed original's.
    misses = []
    for _ in range(5000):
        candidate = nn.Parameter(model.head.weight.detach().clone())
        if id(candidate) in freed:
            model.head.weight = candidate
            break
        misses.append(candidate)
    del misses
    reused = bool({id(p) for p in model.head.parameters()} & freed)
    shard(model)
    return model, reused


def layer_by_layer_sharding_reports_no_false_tie() -> None:
    """torch's ``test_layer_by_layer_shard_no_false_positive``, with a head reusing an id."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh()
    ours, reused = _layer_by_layer(fully_shard)
    assert reused, f"rank {rank}: no parameter reused a freed id; the scenario tests nothing"
    theirs, _ = _layer_by_layer(lambda m: torch_fully_shard(m, mesh=mesh))
    batches = make_batches("blocks", 2, 8)
    batches = [b[:, :8] for b in batches]
    got, want = train_steps(ours, batches, rank, world), train_steps(theirs, batches, rank, world)
    assert got == want, f"rank {rank}: losses {got} vs FSDP2 {want}"
    _same("params after layer-by-layer sharding", full_params(ours), full_params(theirs))


SCENARIOS = [
    *cases(an_unset_reduce_dtype_reduces_as_the_installed_fsdp2, "policy", ["torch", "cadence"]),
    *scenarios(a_policy_field_cadence_cannot_honour_is_refused_by_name),
    *cases(a_list_of_modules_is_refused_naming_the_fix, "form", ["list", "tuple"]),
    *scenarios(post_accumulate_grad_hooks_fire_once_per_synced_backward),
    *scenarios(optimizer_in_backward_matches_fsdp2),
    *cases(a_container_without_forward_is_refused_as_fsdp2, "kind", ["ModuleList", "ModuleDict"]),
    *scenarios(
        a_0dim_parameter_is_refused_as_fsdp2, deepcopy_of_a_sharded_module_is_refused_as_fsdp2
    ),
    *cases(siblings_sharing_a_parameter_are_refused, "when", ["tied_before", "tied_after"]),
    *scenarios(layer_by_layer_sharding_reports_no_false_tie),
]
