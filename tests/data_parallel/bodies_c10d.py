"""Scenarios: the behaviours torch's own CPU DDP tests check, with parity against DDP.

torch's ``test/distributed/test_c10d_gloo.py`` (``DistributedDataParallelTest``) and
``test_c10d_common.py`` check, on gloo and CPU: a grad-enabled forward whose output
is dropped, sparse gradients inside the wrapper, comm hooks (a future that yields a
new tensor, a raw process group as state, sparse buckets, misuse), mixed dtypes and
PowerSGD; a few of its GPU-decorated tests check behaviours that do not depend on the
device (static graph with unused parameters, dataclass outputs, two forwards before
one backward, non-reentrant checkpointing, a checkpoint loaded into a plain model).
Each scenario runs the same steps under `cadence.DataParallel` and torch's DDP (and,
where it is cheap, one process on the global batch) and compares gradients,
parameters or errors. The list, with each behaviour's scenario, is in
``docs/torch-suite.md``. `SCENARIOS` runs in one world-2 launch.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import cadence
from cadence.data_parallel import DataParallelError
from cadence.testing import max_abs_diff, named_params
from tests._scenarios import assert_raises, cases, scenarios
from tests.data_parallel.common import WIDTH, global_batch, local, make_mlp, strip

STEPS = 3


def _dense_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by name, without the wrapper's prefix; sparse ones made dense."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[name.removeprefix("module.")] = p.grad.to_dense() if p.grad.is_sparse else p.grad
    return out


def _same(what: str, got: dict[str, Any], want: dict[str, Any], tol: float = 1e-6) -> None:
    rank = dist.get_rank()
    assert set(got) == set(want), f"rank {rank} {what}: names {sorted(got)} vs {sorted(want)}"
    diff = max_abs_diff(got, want)
    assert diff < tol, f"rank {rank} {what}: max difference {diff:.3e} (tolerance {tol})"


def _sgd_step(model: nn.Module, lr: float = 0.1) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad  # sparse gradients subtract into a dense parameter too


# -- a grad-enabled forward whose output is dropped --------------------------------------


class _ThreeLayers(nn.Module):
    """torch's test model: ``fc3`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.fc1 = nn.Linear(WIDTH, 10, bias=False)
        self.fc2 = nn.Linear(10, 4, bias=False)
        self.fc3 = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def an_ignored_output_then_training_matches_ddp(find_unused: bool) -> None:
    """Four forwards with grad enabled whose outputs are dropped (validation code that
    forgot ``no_grad``), then four training steps: the same parameters as DDP's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _ThreeLayers()
    kwargs = {"find_unused_parameters": find_unused}
    if not find_unused:
        model.fc3.requires_grad_(False)  # unused without find_unused: frozen, as torch's test
    dp = cadence.DataParallel(copy.deepcopy(model), **kwargs)
    ddp = DDP(copy.deepcopy(model), **kwargs)
    for step in range(4):
        x, _ = global_batch(step, world)
        for m in (dp, ddp):
            out = m(local(x, rank, world))
            del out  # no backward: the forward's graph is dropped
    for step in range(4, 8):
        x, _ = global_batch(step, world)
        target = torch.full((x.shape[0] // world,), rank % 4, dtype=torch.long)
        for m in (dp, ddp):
            m.zero_grad(set_to_none=True)
            F.cross_entropy(m(local(x, rank, world)), target).backward()
            _sgd_step(m)
        _same(f"step {step} grads", _dense_grads(dp), _dense_grads(ddp))
    _same("params", strip(named_params(dp)), strip(named_params(ddp)))


# -- sparse gradients -----------------------------------------------------------------


class _SparseNet(nn.Module):
    """An embedding bag with sparse gradients feeding a dense head (a recommender's shape)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.emb = nn.EmbeddingBag(40, 8, mode="sum", sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


def _sparse_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, 40, (world * 4, 3), generator=g), torch.randn(world * 4, 1, generator=g)


SPARSE_CASES = {
    "auto": {},
    "manual": {},
    "bucket_view": {"gradient_as_bucket_view": True},
    "no_sync": {},
    "find_unused": {"find_unused_parameters": True},
}


def sparse_gradients_match_ddp_and_one_process(case: str) -> None:
    """An ``EmbeddingBag(sparse=True)`` inside the wrapper: its sparse gradient is reduced in
    a bucket of its own; gradients and parameters equal DDP's and one process's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, kwargs = _SparseNet(), SPARSE_CASES[case]
    ref = copy.deepcopy(model)
    dp = cadence.DataParallel(copy.deepcopy(model), **kwargs)
    ddp = DDP(copy.deepcopy(model), **kwargs)
    dp.require_manual_backward_finalization = case == "manual"
    assert dp.bucket_param_names() == [["emb.weight"], ["head.weight", "head.bias"]] or (
        dp.bucket_param_names() == [["head.weight", "head.bias"], ["emb.weight"]]
    ), f"rank {rank}: buckets {dp.bucket_param_names()}"
    micro = 2 if case == "no_sync" else 1
    for step in range(STEPS):
        for m in (dp, ddp, ref):
            m.zero_grad(set_to_none=True)
        before = dp.event_log.count("all_reduce")
        for k in range(micro):
            idx, y = _sparse_batch(step * micro + k, world)
            last = k == micro - 1
            for m in (dp, ddp):
                with m.no_sync() if not last else _nothing():
                    out = m(local(idx, rank, world))
                    (F.mse_loss(out, local(y, rank, world)) / micro).backward()
            (F.mse_loss(ref(idx), y) / micro).backward()
        if case == "manual":
            dp.finalize_backward()
        reduces = dp.event_log.count("all_reduce") - before
        want = dp.num_buckets + (1 if case == "find_unused" else 0)  # + the used map
        assert reduces == want, f"rank {rank} step {step}: {reduces} all-reduces, want {want}"
        grad = dp.module.emb.weight.grad
        assert grad is not None and grad.is_sparse, f"rank {rank}: emb grad {grad!r}"
        _same(f"{case} step {step} grads vs DDP", _dense_grads(dp), _dense_grads(ddp))
        _same(f"{case} step {step} grads vs one process", _dense_grads(dp), _dense_grads(ref))
        for m in (dp, ddp, ref):
            _sgd_step(m)
    _same(f"{case} params vs DDP", strip(named_params(dp)), strip(named_params(ddp)))


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def a_dense_use_of_a_sparse_weight_is_refused_by_name() -> None:
    """Tied weights make an embedding's gradient dense: refused naming the parameter."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4, sparse=True)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.emb(idx) @ self.emb.weight.t()

    dp = cadence.DataParallel(Tied())
    loss = dp(torch.tensor([1, 2])).sum()
    assert_raises(loss.backward, "'emb.weight'", "sparse=False", kind=DataParallelError)
    dp.reset_iter_state()


# -- comm hooks -----------------------------------------------------------------------


# [Note: hooks without annotations]
# DDP compares a hook's annotations with the classes themselves, and under this
# file's ``from __future__ import annotations`` every annotation is a string, which
# DDP refuses; so the hooks both wrappers get carry none, and the misuse cases set
# real ones by hand.


def _future_of_ones_plus_one(state, bucket):  # see [Note: hooks without annotations]
    """torch's ``_simple_hook``: a hand-made future, chained; reduces nothing."""
    fut = torch.futures.Future()
    fut.set_result(torch.ones_like(bucket.buffer()))
    return fut.then(lambda f: f.value() + torch.ones_like(f.value()))


def a_hook_future_yielding_a_new_tensor_becomes_the_gradient() -> None:
    """The hook's future yields a fresh tensor (not the bucket): it is what ``.grad`` gets,
    as under DDP: every gradient is 2."""
    rank = dist.get_rank()
    grads = {}
    for name, wrap in (("cadence", cadence.DataParallel), ("DDP", DDP)):
        m = wrap(make_mlp(4), bucket_cap_mb=0.001)
        m.register_comm_hook(None, _future_of_ones_plus_one)
        m(torch.randn(4, WIDTH)).sum().backward()
        grads[name] = _dense_grads(m)
        for n, g in grads[name].items():
            assert torch.equal(g, torch.full_like(g, 2.0)), f"rank {rank} {name}: {n} = {g}"
    _same("grads", grads["cadence"], grads["DDP"])


def _raw_group_hook(pg, bucket):  # see [Note: hooks without annotations]
    """torch's sparse-gradient test hook: the raw ProcessGroup's own all-reduce."""
    world = pg.size()
    return pg.allreduce([bucket.buffer()]).get_future().then(lambda f: f.wait()[0] / world)


def a_raw_process_group_hook_matches_ddp(model: str) -> None:
    """A hook whose state is a torch ``ProcessGroup``, on dense and on sparse buckets."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base: nn.Module = _SparseNet() if model == "sparse" else make_mlp(6)
    wrapped = [cadence.DataParallel(copy.deepcopy(base)), DDP(copy.deepcopy(base))]
    for m in wrapped:
        m.register_comm_hook(dist.group.WORLD, _raw_group_hook)
    ref = copy.deepcopy(base)
    for step in range(STEPS):
        if model == "sparse":
            x, y = _sparse_batch(step, world)
        else:
            x, y = global_batch(step, world)
        for m in (*wrapped, ref):
            m.zero_grad(set_to_none=True)
        for m in wrapped:
            F.mse_loss(m(local(x, rank, world)), local(y, rank, world)).backward()
        F.mse_loss(ref(x), y).backward()
        _same(f"{model} step {step} vs DDP", _dense_grads(wrapped[0]), _dense_grads(wrapped[1]))
        _same(f"{model} step {step} vs one process", _dense_grads(wrapped[0]), _dense_grads(ref))
        for m in (*wrapped, ref):
            _sgd_step(m)


def _hook_returning_one(state, bucket):  # see [Note: hooks without annotations]
    return 1


def _bad_bucket_annotation(state, bucket):  # see [Note: hooks without annotations]
    raise AssertionError("never called")


def _bad_return_annotation(state, bucket):  # see [Note: hooks without annotations]
    raise AssertionError("never called")


_bad_bucket_annotation.__annotations__ = {"bucket": int, "return": torch.futures.Future}
_bad_return_annotation.__annotations__ = {"bucket": dist.GradBucket, "return": int}


HOOK_MISUSE: dict[str, tuple[Callable[[nn.Module], object], type[BaseException], str]] = {
    "not_callable": (
        lambda m: m.register_comm_hook(None, 1),
        TypeError,
        "Communication hook must be callable.",
    ),
    "bucket_annotation": (
        lambda m: m.register_comm_hook(None, _bad_bucket_annotation),
        ValueError,
        "bucket annotation should be dist.GradBucket.",
    ),
    "return_annotation": (
        lambda m: m.register_comm_hook(None, _bad_return_annotation),
        ValueError,
        "return annotation should be torch.futures.Future",
    ),
    "registered_twice": (
        lambda m: [m.register_comm_hook(None, _future_of_ones_plus_one) for _ in range(2)],
        RuntimeError,
        "register_comm_hook or register_builtin_comm_hook can only be called once",
    ),
    "returns_no_future": (
        lambda m: (
            m.register_comm_hook(None, _hook_returning_one),
            m(torch.randn(2, WIDTH)).sum().backward(),
        ),
        RuntimeError,
        "callback must return a torch.futures.Future object, but got",
    ),
}


def comm_hook_misuse_is_refused_as_ddp_refuses(case: str) -> None:
    """The same error type and words as DDP (torch's tests match them), cadence's too."""
    misuse, kind, words = HOOK_MISUSE[case]
    for wrap in (DDP, cadence.DataParallel):
        assert_raises(lambda: misuse(wrap(make_mlp(7))), words, kind=kind)  # noqa: B023  # called at once


def builtin_comm_hooks_register_as_under_ddp() -> None:
    """``_register_builtin_comm_hook(dist.BuiltinCommHookType.X)``: cadence's own hook for X."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, world)
    grads = {}
    for kind in (dist.BuiltinCommHookType.ALLREDUCE, dist.BuiltinCommHookType.FP16_COMPRESS):
        for name, wrap in (("cadence", cadence.DataParallel), ("DDP", DDP)):
            m = wrap(make_mlp(8))
            m._register_builtin_comm_hook(kind)
            F.mse_loss(m(local(x, rank, world)), local(y, rank, world)).backward()
            grads[name] = _dense_grads(m)
        _same(f"{kind}", grads["cadence"], grads["DDP"], tol=1e-3 if "FP16" in str(kind) else 1e-6)


def ignored_names_set_as_ddp_sets_them() -> None:
    """The static ``_set_params_and_buffers_to_ignore_for_model`` marks names both honour."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_mlp(9)
    ignored = ["0.weight", "0.bias"]
    cadence.DataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    assert getattr(model[0].weight, "_ddp_ignored", False), "the parameter is not marked"
    dp = cadence.DataParallel(copy.deepcopy(model))
    ddp = DDP(copy.deepcopy(model))
    assert all("0." not in n for names in dp.bucket_param_names() for n in names), (
        f"rank {rank}: ignored names in buckets {dp.bucket_param_names()}"
    )
    x, y = global_batch(0, world)
    for m in (dp, ddp):
        F.mse_loss(m(local(x, rank, world)), local(y, rank, world)).backward()
    _same("grads (the ignored layer keeps its local gradient)", _dense_grads(dp), _dense_grads(ddp))


# -- dtypes and PowerSGD ----------------------------------------------------------------


class _MixedDtypes(nn.Module):
    """float64 then float32 layers, as torch's Reducer tests: one bucket per dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(WIDTH, 8).double()
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x.double())).float())


def mixed_dtypes_reduce_per_dtype_as_ddp() -> None:
    """A float64 + float32 model: buckets never mix dtypes; gradients equal DDP's and one
    process's, in their own dtypes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _MixedDtypes()
    ref, ddp = copy.deepcopy(model), DDP(copy.deepcopy(model), bucket_cap_mb=1000)
    dp = cadence.DataParallel(copy.deepcopy(model), bucket_cap_mb=1000)
    for bucket in dp._reducer.buckets:
        dtypes = {p.dtype for p in bucket.params}
        assert len(dtypes) == 1 and bucket.buffer.dtype in dtypes, f"a bucket of {dtypes}"
    assert dp.num_buckets == 2, f"rank {rank}: {dp.bucket_param_names()}"
    for step in range(STEPS):
        x, y = global_batch(step, world)
        for m in (dp, ddp, ref):
            m.zero_grad(set_to_none=True)
        for m in (dp, ddp):
            F.mse_loss(m(local(x, rank, world)), local(y, rank, world)).backward()
        F.mse_loss(ref(x), y).backward()
        got = _dense_grads(dp)
        assert got["a.weight"].dtype == torch.float64, got["a.weight"].dtype
        _same(f"step {step} vs DDP", got, _dense_grads(ddp))
        _same(f"step {step} vs one process", got, _dense_grads(ref))
        for m in (dp, ddp, ref):
            _sgd_step(m)


def powersgd_hook_matches_ddp() -> None:
    """torch's ``powerSGD_hook`` registered on cadence: DDP's compressed gradients exactly
    (the same iteration count, error feedback and warm start).

    One bucket with one compressed matrix: DDP rebuilds its buckets after the first step
    with their gradients in arrival order while cadence keeps registration order, and
    PowerSGD's random start depends on the order of the matrices it compresses (the
    second weight, 1 x 16, is too small to compress: it is all-reduced as it is). One
    bucket also keeps every rank's collectives in one order: PowerSGD issues its second
    all-reduce from a callback, which on gloo may interleave with another bucket's.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(32, 16, bias=False), nn.Tanh(), nn.Linear(16, 1, bias=False))
    wrapped = [cadence.DataParallel(copy.deepcopy(model)), DDP(copy.deepcopy(model))]
    assert wrapped[0].num_buckets == 1, wrapped[0].bucket_param_names()
    for m in wrapped:
        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        m.register_comm_hook(state, powersgd.powerSGD_hook)
    for step in range(4):  # iterations 0-1 all-reduce plainly, 2-3 compress
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(world * 4, 32, generator=g), torch.randn(world * 4, 1, generator=g)
        for m in wrapped:
            m.zero_grad(set_to_none=True)
            F.mse_loss(m(local(x, rank, world)), local(y, rank, world)).backward()
        _same(f"step {step} grads", _dense_grads(wrapped[0]), _dense_grads(wrapped[1]), tol=1e-6)
        for m in wrapped:
            _sgd_step(m)


# -- GPU-decorated in torch's suite, device-independent in behaviour --------------------


class _PartlyUsed(nn.Module):
    """``never`` is used by no rank; ``rank0`` by rank 0 only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.never = nn.Linear(WIDTH, 1)
        self.rank0 = nn.Linear(WIDTH, 1)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.head(h) + (self.rank0(h) if dist.get_rank() == 0 else 0)


def static_graph_with_unused_parameters_matches_ddp(as_view: bool) -> None:
    """``static_graph=True`` with a globally and a locally unused parameter: the globally
    unused one keeps no gradient, the locally unused one gets the average, as DDP."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _PartlyUsed()
    kwargs = {"static_graph": True, "gradient_as_bucket_view": as_view}
    dp, ddp = (
        cadence.DataParallel(copy.deepcopy(model), **kwargs),
        DDP(copy.deepcopy(model), **kwargs),
    )
    for step in range(STEPS):
        x, y = global_batch(step, world)
        for m in (dp, ddp):
            m.zero_grad(set_to_none=True)
            F.mse_loss(m(local(x, rank, world)), local(y, rank, world)).backward()
        got, want = _dense_grads(dp), _dense_grads(ddp)
        _same(f"step {step} grads", got, want)
        assert "rank0.weight" in got, f"rank {rank}: a locally unused parameter has no gradient"
        for m in (dp, ddp):
            _sgd_step(m)


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    aux: torch.Tensor | None
    extra: dict[str, torch.Tensor]


class _DataclassOut(nn.Module):
    def __init__(self, use_aux: bool) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.a = nn.Linear(WIDTH, 1)
        self.b = nn.Linear(WIDTH, 1)  # unused when use_aux is off
        self.use_aux = use_aux

    def forward(self, x: torch.Tensor) -> _Output:
        aux = self.b(x) if self.use_aux else None
        return _Output(self.a(x), aux, {"h": self.a(x) * 2})


def a_dataclass_output_matches_ddp(use_aux: bool) -> None:
    """A forward returning a dataclass (an Optional field, a dict of tensors), with
    ``find_unused_parameters``: the same gradients as DDP, unused ``b`` included."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _DataclassOut(use_aux)
    dp = cadence.DataParallel(copy.deepcopy(model), find_unused_parameters=True)
    ddp = DDP(copy.deepcopy(model), find_unused_parameters=True)
    for step in range(STEPS):
        x, y = global_batch(step, world)
        for m in (dp, ddp):
            m.zero_grad(set_to_none=True)
            out = m(local(x, rank, world))
            loss = F.mse_loss(out.logits + out.extra["h"], local(y, rank, world))
            if out.aux is not None:
                loss = loss + out.aux.pow(2).mean()
            loss.backward()
        _same(f"step {step} grads", _dense_grads(dp), _dense_grads(ddp))
        for m in (dp, ddp):
            _sgd_step(m)


def two_forwards_one_backward_with_batchnorm_match_ddp() -> None:
    """Two forwards, then one backward of their sum, with BatchNorm buffers broadcast:
    gradients, parameters and running statistics equal DDP's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(WIDTH, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    dp, ddp = cadence.DataParallel(copy.deepcopy(model)), DDP(copy.deepcopy(model))
    for step in range(STEPS):
        x, y = global_batch(step, world)
        x2, _ = global_batch(step + 100, world)
        for m in (dp, ddp):
            m.zero_grad(set_to_none=True)
            out1 = m(local(x, rank, world))
            out2 = m(local(x2, rank, world) * (rank + 1))  # ranks' statistics differ
            F.mse_loss(out1 + out2, local(y, rank, world)).backward()
        _same(f"step {step} grads", _dense_grads(dp), _dense_grads(ddp))
        for m in (dp, ddp):
            _sgd_step(m)
    want = {k: v.float() for k, v in ddp.module.state_dict().items()}
    got = {k: v.float() for k, v in dp.module.state_dict().items()}
    _same("state dict (running statistics included)", got, want)


class _SharedCheckpointed(nn.Module):
    """One layer used twice, each use checkpointed without reentrancy (weight sharing)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.shared, x, use_reentrant=False)
        h = checkpoint(self.shared, torch.tanh(h), use_reentrant=False)
        return self.head(h)


def non_reentrant_checkpointing_with_shared_weights_matches_ddp(static: bool) -> None:
    """Non-reentrant activation checkpointing of a layer used twice: DDP's gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _SharedCheckpointed()
    dp = cadence.DataParallel(copy.deepcopy(model), static_graph=static)
    ddp = DDP(copy.deepcopy(model), static_graph=static)
    ref = copy.deepcopy(model)
    for step in range(STEPS):
        x, y = global_batch(step, world)
        for m in (dp, ddp, ref):
            m.zero_grad(set_to_none=True)
        for m in (dp, ddp):
            F.mse_loss(m(local(x, rank, world)), local(y, rank, world)).backward()
        F.mse_loss(ref(x), y).backward()
        _same(f"step {step} vs DDP", _dense_grads(dp), _dense_grads(ddp))
        _same(f"step {step} vs one process", _dense_grads(dp), _dense_grads(ref))
        for m in (dp, ddp, ref):
            _sgd_step(m)


def a_saved_state_dict_loads_into_a_plain_model_as_ddps() -> None:
    """``state_dict()`` of the wrapper, saved, with ``module.`` stripped by torch's
    ``consume_prefix_in_state_dict_if_present``: loads into the bare model, as DDP's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_mlp(11)
    dp, ddp = cadence.DataParallel(copy.deepcopy(model)), DDP(copy.deepcopy(model))
    x, y = global_batch(0, world)
    for m in (dp, ddp):
        F.mse_loss(m(local(x, rank, world)), local(y, rank, world)).backward()
        _sgd_step(m)
    loaded = {}
    for name, m in (("cadence", dp), ("DDP", ddp)):
        sd = copy.deepcopy(m.state_dict())
        assert all(k.startswith("module.") for k in sd), f"{name}: keys {list(sd)[:3]}"
        nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "module.")
        plain = make_mlp(0)
        plain.load_state_dict(sd)
        loaded[name] = dict(plain.state_dict())
    _same("plain models", loaded["cadence"], loaded["DDP"], tol=0.0 + 1e-12)


SCENARIOS = [
    *cases(an_ignored_output_then_training_matches_ddp, "find_unused", [False, True]),
    *cases(sparse_gradients_match_ddp_and_one_process, "case", list(SPARSE_CASES)),
    *scenarios(
        a_dense_use_of_a_sparse_weight_is_refused_by_name,
        a_hook_future_yielding_a_new_tensor_becomes_the_gradient,
    ),
    *cases(a_raw_process_group_hook_matches_ddp, "model", ["dense", "sparse"]),
    *cases(comm_hook_misuse_is_refused_as_ddp_refuses, "case", list(HOOK_MISUSE)),
    *scenarios(
        builtin_comm_hooks_register_as_under_ddp,
        ignored_names_set_as_ddp_sets_them,
        mixed_dtypes_reduce_per_dtype_as_ddp,
        powersgd_hook_matches_ddp,
    ),
    *cases(static_graph_with_unused_parameters_matches_ddp, "as_view", [False, True]),
    *cases(a_dataclass_output_matches_ddp, "use_aux", [True, False]),
    *scenarios(two_forwards_one_backward_with_batchnorm_match_ddp),
    *cases(non_reentrant_checkpointing_with_shared_weights_matches_ddp, "static", [False, True]),
    *scenarios(a_saved_state_dict_loads_into_a_plain_model_as_ddps),
]
