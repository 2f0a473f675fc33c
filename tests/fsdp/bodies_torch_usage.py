"""Scenarios: how scripts use a sharded model around its steps, with parity against FSDP2.

torch's ``test_fully_shard_clip_grad_norm_.py``, ``test_fully_shard_grad_scaler.py``,
``test_fully_shard_training.py`` (``test_register_fsdp_forward_method``,
``test_gradient_accumulation``, ``test_1f1b_microbatching``),
``test_fully_shard_init.py`` (``test_fully_shard_cls``,
``test_raise_noncontiguous_parameter``) check what a training script does between
and around the unit hooks: clipping with any norm type, a gradient scaler with an
``inf`` on one rank, a method other than ``forward`` as an entry point, accumulation
flags set on some units only, every unit unsharded up front before the microbatches,
slicing a sharded ``Sequential``, and a ``channels_last`` parameter. Each scenario runs
the same steps under `cadence.fully_shard` and torch's ``fully_shard`` (see `_Pair`)
and compares losses, ``full_tensor()`` gradients, parameters and, where stated,
collective counts or the error. Each docstring names the torch test it ports.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import register_fsdp_forward_method as torch_register
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Shard as Shard0
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from cadence.fsdp import (
    FullyShardedModule,
    FullyShardError,
    FullyShardValueError,
    register_fsdp_forward_method,
)
from cadence.fsdp import fully_shard as cadence_fully_shard
from cadence.fsdp._mp_rules import REDUCE_DEFAULTS_TO_ORIG_DTYPE
from cadence.testing import max_abs_diff
from tests._scenarios import assert_raises, cases, scenarios
from tests.fsdp.bodies_torch_runtime import (
    DIM,
    STEPS,
    Shard,
    _batch,
    _full_grads,
    _local,
    _mesh,
    _Pair,
    _same,
    _same_counts,
    _same_loss,
)


def _mlp(seed: int, depth: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(DIM, DIM), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _shard_linears(m: nn.Module, shard: Shard) -> None:
    for child in m:
        if isinstance(child, nn.Linear):
            shard(child, None)
    shard(m, None)


def _step(opts: list[torch.optim.Optimizer], *, set_to_none: bool = True) -> None:
    for o in opts:
        o.step()
        o.zero_grad(set_to_none=set_to_none)


def _total(norm: torch.Tensor) -> float:
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


# -- 1. clipping and the gradient scaler ----------------------------------------------------


def clipping_with_each_norm_type_matches_fsdp2(norm: str) -> None:
    """torch's ``test_clip_grad_norm_1d`` for norm types 1, 2 and inf: the total norm that
    ``clip_grad_norm_`` returns over sharded gradients, the clipped gradients and the
    parameters after each step equal FSDP2's."""
    norm_type = math.inf if norm == "inf" else float(norm)
    with _Pair(_mlp(11), _shard_linears) as pair:
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pair.ours, pair.theirs)]
        for step in range(STEPS):
            x = _local(_batch(step))
            totals = []
            for m in (pair.ours, pair.theirs):
                m(x).pow(2).sum().backward()
                # Small enough that every step clips: the scaling is what is compared.
                totals.append(
                    _total(nn.utils.clip_grad_norm_(m.parameters(), 0.05, norm_type=norm_type))
                )
            assert math.isclose(totals[0], totals[1], rel_tol=1e-6), (
                f"rank {dist.get_rank()} norm {norm} step {step}: total norm "
                f"{totals[0]!r} (cadence) vs {totals[1]!r} (FSDP2)"
            )
            assert totals[0] > 0.05, f"norm {norm} step {step}: {totals[0]} did not clip"
            pair.check(f"norm {norm} step {step} clipped")
            _step(opts)
        pair.check(f"norm {norm} end", grads=False)


def a_gradient_scaler_skips_a_step_with_inf_on_one_rank_as_fsdp2(has_inf: bool) -> None:
    """torch's ``test_gradient_scaler`` (1-D): ``unscale_`` finds an ``inf`` that only rank 1
    holds on every rank, the step is skipped and the scale backs off, as under FSDP2;
    without one, both step and keep the scale. Parameters equal FSDP2's."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
    with _Pair(model, _shard_linears) as pair:
        x = _local(
            torch.randn(2 * dist.get_world_size(), 4, generator=torch.Generator().manual_seed(1))
        )
        for name, m in (("cadence", pair.ours), ("FSDP2", pair.theirs)):
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
            opt = torch.optim.Adam(m.parameters(), lr=1e-2)
            before = {n: p.detach().full_tensor().clone() for n, p in m.named_parameters()}
            scaler.scale(m(x).sum()).backward()
            grad = opt.param_groups[0]["params"][0].grad
            assert isinstance(grad, DTensor), f"rank {rank} {name}: grad is {type(grad).__name__}"
            if has_inf and rank == 1:
                grad.to_local()[0, 0].fill_(float("inf"))
            scaled = grad.to_local().clone()
            scaler.unscale_(opt)
            found = [
                float(f)
                for f in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()
            ]
            assert found == [float(has_inf)], (
                f"rank {rank} {name}: found_inf {found}, inf={has_inf}"
            )
            unscaled = grad.to_local()
            if not has_inf:
                assert torch.equal(unscaled, scaled / 2.0), (
                    f"rank {rank} {name}: not unscaled by 1/2"
                )
            scaler.step(opt)
            scaler.update()
            want_scale = 2.0 * scaler.get_backoff_factor() if has_inf else 2.0
            assert scaler.get_scale() == want_scale, (
                f"rank {rank} {name}: scale {scaler.get_scale()} after update, want {want_scale}"
            )
            after = {n: p.detach().full_tensor() for n, p in m.named_parameters()}
            moved = sorted(n for n in after if not torch.equal(after[n], before[n]))
            want_moved = [] if has_inf else sorted(after)
            assert moved == want_moved, f"rank {rank} {name}: stepped {moved}, want {want_moved}"
        pair.check(f"inf={has_inf}", grads=False)


# -- 2. a method other than forward -----------------------------------------------------------


class _Vit(nn.Module):
    """torch's ``VisionTransformer``, small: ``forward_features`` is a second entry point."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_proj = nn.Conv2d(3, DIM, kernel_size=2, stride=2)

    def forward_features(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.patch_proj(imgs).flatten(2).transpose(1, 2)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.forward_features(imgs).sum(dim=1)


class _VitModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(12)
        self.vit = _Vit()
        self.projector = nn.Linear(DIM, 4)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vit.forward_features(imgs))  # not vit(...)


def a_registered_forward_method_trains_as_fsdp2() -> None:
    """torch's ``test_register_fsdp_forward_method``: ``vit.forward_features`` called in
    place of ``vit(...)`` gathers the unit once registered; losses, gradients,
    parameters and per-step collective counts equal FSDP2's."""

    def apply(m: nn.Module, shard: Shard) -> None:
        shard(m.vit, None)
        shard(m.projector, None)
        shard(m, None)

    with _Pair(_VitModel(), apply) as pair:
        register_fsdp_forward_method(pair.ours.vit, "forward_features")
        torch_register(pair.theirs.vit, "forward_features")
        opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (pair.ours, pair.theirs)]
        g = torch.Generator().manual_seed(3)
        for step in range(STEPS):
            imgs = _local(torch.randn(2 * dist.get_world_size(), 3, 4, 4, generator=g))
            pair.backward(f"step {step}", lambda m, imgs=imgs: m(imgs).sum())
            _same_counts(f"step {step}", *pair.counts())
            pair.check(f"step {step}")
            _step(opts)
        pair.check("end", grads=False)


def registering_a_forward_method_checks_its_name() -> None:
    """As FSDP2's: a module fully_shard did not wrap is left alone (a script runs with
    and without sharding), and a name the unit lacks is refused, naming it."""
    plain = _Vit()
    register_fsdp_forward_method(plain, "forward_features")
    assert "forward_features" not in vars(plain), "a plain module was patched"
    unit = _Vit()
    cadence_fully_shard(unit)
    assert_raises(
        lambda: register_fsdp_forward_method(unit, "forward_feature"),
        "'forward_feature'",
        "forward_features",
        kind=FullyShardValueError,
    )


# -- 3. accumulation flags on some units; every unit unsharded up front ---------------------------


def _units(m: nn.Module, lib: str) -> list[nn.Module]:
    cls = FullyShardedModule if lib == "cadence" else FSDPModule
    return [u for u in m.modules() if isinstance(u, cls)]


def accumulation_flags_on_some_units_match_fsdp2(mode: str) -> None:
    """torch's ``_test_gradient_accumulation``, modes ``root_only`` (the root's own
    ``set_requires_gradient_sync(False, recurse=False)``) and ``some_mlps`` (sync off on
    two of the three inner units), two microbatches without sync and one with, raf
    True and False: gradients after the synced microbatch, parameters and per-step
    collective counts equal FSDP2's."""
    for raf in (True, False):

        def apply(m: nn.Module, shard: Shard, raf: bool = raf) -> None:
            for child in m:
                if isinstance(child, nn.Linear):
                    shard(child, raf)
            shard(m, raf)

        model = _mlp(13)
        model.append(nn.Linear(DIM, 2))  # a parameter the root unit owns itself
        with _Pair(model, apply) as pair:
            opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pair.ours, pair.theirs)]
            for step in range(STEPS):
                for mb in range(3):
                    last = mb == 2
                    for m in (pair.ours, pair.theirs):
                        if mode == "root_only":
                            m.set_requires_gradient_sync(last, recurse=False)
                        else:
                            for unit in (m[0], m[4]):
                                unit.set_requires_gradient_sync(last)
                    x = _local(_batch(step * 3 + mb))
                    pair.backward(
                        f"{mode} raf={raf} step {step} mb {mb}", lambda m, x=x: m(x).sum()
                    )
                _same_counts(f"{mode} raf={raf} step {step}", *pair.counts())
                pair.check(f"{mode} raf={raf} step {step}")
                _step(opts, set_to_none=step % 2 == 1)
            pair.check(f"{mode} raf={raf} end", grads=False)


def every_unit_unsharded_up_front_matches_fsdp2() -> None:
    """torch's ``_test_1f1b_microbatching``: ``reshard_after_forward=False``, every unit's
    ``unshard(async_op=True)`` issued and waited before the microbatches, sync,
    is-last-backward and reshard-after-backward set on the last one only: gradients,
    parameters and per-step collective counts equal FSDP2's."""

    def apply(m: nn.Module, shard: Shard) -> None:
        for child in m:
            if isinstance(child, nn.Linear):
                shard(child, False)
        shard(m, False)

    with _Pair(_mlp(14), apply) as pair:
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pair.ours, pair.theirs)]
        for step in range(STEPS):
            for lib, m in (("cadence", pair.ours), ("FSDP2", pair.theirs)):
                handles = [u.unshard(async_op=True) for u in _units(m, lib)]
                assert all(h is not None for h in handles), f"{lib}: unshard(async_op) gave None"
                for h in handles:
                    h.wait()
            for mb in range(3):
                last = mb == 2
                for m in (pair.ours, pair.theirs):
                    m.set_requires_gradient_sync(last)
                    m.set_is_last_backward(last)
                    m.set_reshard_after_backward(last)
                x = _local(_batch(step * 3 + mb))
                pair.backward(f"step {step} mb {mb}", lambda m, x=x: m(x).sum())
            ours, theirs = pair.counts()
            # Each unit gathers once per step (up front) and reduces once. FSDP2's
            # backward of the last microbatch, where reshard-after-backward turns on,
            # gathers one unit once more: (4, 3) on torch 2.15.
            assert ours == (3, 3) and ours[1] == theirs[1] and ours[0] <= theirs[0], (
                f"rank {dist.get_rank()} step {step}: (all-gathers, reduce-scatters) "
                f"{ours} (cadence, want (3, 3)) vs {theirs} (FSDP2)"
            )
            pair.check(f"step {step}")
            _step(opts)
        pair.check("end", grads=False)


# -- 4. module classes: slices and memory formats ---------------------------------------------


def slicing_a_sharded_sequential_gives_a_plain_sequential() -> None:
    """torch's ``test_fully_shard_cls``: ``sharded[:2]`` is a plain ``Sequential`` holding
    the same children (which keep their own classes), with FSDP2's state-dict keys; run
    alone, it trains as FSDP2's slice does."""
    rank = dist.get_rank()
    with _Pair(_mlp(15), _shard_linears) as pair:
        parts = {}
        for lib, m in (("cadence", pair.ours), ("FSDP2", pair.theirs)):
            part = m[:3]
            assert type(part) is nn.Sequential, f"rank {rank} {lib}: slice is {type(part).__name__}"
            assert all(a is b for a, b in zip(part, list(m)[:3], strict=True)), (
                f"rank {rank} {lib}: the slice holds other children"
            )
            parts[lib] = part
        keys = [sorted(p.state_dict()) for p in parts.values()]
        assert keys[0] == keys[1], f"rank {rank}: slice keys {keys[0]} vs FSDP2 {keys[1]}"
        x = _local(_batch(0))
        losses = []
        for part in parts.values():
            loss = part(x).sum()
            loss.backward()
            losses.append(float(loss.detach()))
        _same_loss("the slice alone", *losses)
        _same("slice grads", *(_full_grads(p) for p in parts.values()))


def a_channels_last_parameter_is_refused_as_fsdp2() -> None:
    """torch's ``test_raise_noncontiguous_parameter``: a ``channels_last`` convolution's
    weight is not contiguous; FSDP2 raises NotImplementedError, and cadence refuses it
    too (a ``NotImplementedError`` as well), naming the parameter and the fix, rather
    than training it in a memory format the user did not choose."""
    conv = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    assert_raises(
        lambda: torch_fully_shard(conv, mesh=_mesh()), "non-contiguous", kind=NotImplementedError
    )
    conv = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    assert_raises(
        lambda: cadence_fully_shard(conv),
        "'weight'",
        "channels_last",
        "contiguous_format",
        kind=NotImplementedError,
    )


# -- 5. a parameter's grad_dtype ---------------------------------------------------------------


def _fp32_grads(m: nn.Module, shard: Shard) -> None:
    # Set on the copies `_Pair` made: deepcopy does not keep a parameter's grad_dtype.
    for p in m.parameters():
        p.grad_dtype = torch.float32
    _shard_linears(m, shard)


def a_parameters_grad_dtype_is_kept_as_fsdp2() -> None:
    """torch 2.15's ``grad_dtype`` policy (``test_fully_shard_grad_dtype.py``): a bf16
    model whose parameters ask for fp32 gradients before ``fully_shard`` gets fp32
    sharded gradients, reduced in fp32, equal to FSDP2's, and the same parameters after
    SGD steps (torch's Adam refuses bf16 parameters with fp32 gradients). torch before
    2.15 drops the setting (bf16 gradients); cadence keeps it there too, and its
    gradients equal FSDP2's within bf16's resolution."""
    rank = dist.get_rank()
    torch.manual_seed(16)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, 2)).to(torch.bfloat16)
    fsdp2_keeps = REDUCE_DEFAULTS_TO_ORIG_DTYPE  # the same torch 2.15 change
    with _Pair(model, _fp32_grads) as pair:
        opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (pair.ours, pair.theirs)]
        for step in range(STEPS):
            x = _local(_batch(step)).to(torch.bfloat16)
            for m in (pair.ours, pair.theirs):
                m(x).float().pow(2).sum().backward()
            for lib, m, want in (
                ("cadence", pair.ours, torch.float32),
                ("FSDP2", pair.theirs, torch.float32 if fsdp2_keeps else torch.bfloat16),
            ):
                got = {n: p.grad.dtype for n, p in m.named_parameters() if p.grad is not None}
                assert set(got) == {n for n, _ in m.named_parameters()} and set(got.values()) == {
                    want
                }, f"rank {rank} {lib} step {step}: grad dtypes {got}, want {want}"
            pair.check(f"step {step}", tol=1e-6 if fsdp2_keeps else 2e-2)
            _step(opts)
        pair.check("end", grads=False, tol=1e-6 if fsdp2_keeps else 2e-2)


def differing_grad_dtypes_in_one_unit_are_refused() -> None:
    """One unit writes one flat gradient: a grad_dtype on some of its parameters only is
    refused, naming them and the fix (FSDP2 reduces such groups in a promoted dtype)."""
    model = nn.Linear(DIM, DIM).to(torch.bfloat16)
    model.weight.grad_dtype = torch.float32
    assert_raises(
        lambda: cadence_fully_shard(model),
        "grad_dtype",
        "'weight'",
        "['bias']",
        "separate unit",
        kind=FullyShardError,
    )


# -- 6. a unit run per chunk outside the root's forward ---------------------------------------------

VOCAB = 16


class _ChunkedHead(nn.Module):
    """torch's ``ChunkedHeadModel``, ungrouped: ``skip_head=True`` stops before the head,
    which the loss then runs per chunk, outside the root's forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(17)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tok: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(torch.relu(self.body(self.embed(tok))))
        return h if skip_head else self.head(h)


def a_head_run_per_chunk_outside_the_root_matches_fsdp2(raf: bool) -> None:
    """torch's ``_test_partial_group_forward_then_standalone`` (ungrouped branch): the
    root's forward skips the head; the loss runs the head unit on each chunk of the
    detached hidden states and backwards each chunk, then the hidden states' gradient
    goes back through the root. Losses, gradients, parameters and per-step collective
    counts equal FSDP2's, with raf True and False."""

    def apply(m: nn.Module, shard: Shard) -> None:
        for child in (m.embed, m.body, m.norm, m.head):
            shard(child, raf)
        shard(m, raf)

    with _Pair(_ChunkedHead(), apply) as pair:
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pair.ours, pair.theirs)]
        g = torch.Generator().manual_seed(5)
        for step in range(STEPS):
            tok = _local(torch.randint(0, VOCAB, (2 * dist.get_world_size(), 6), generator=g))
            target = tok.roll(-1, dims=1)
            losses = []
            for m in (pair.ours, pair.theirs):
                h = m(tok, skip_head=True)
                hd = h.detach().requires_grad_()
                total = 0.0
                for chunk, want in zip(hd.split(2, dim=1), target.split(2, dim=1), strict=True):
                    loss = nn.functional.cross_entropy(m.head(chunk).flatten(0, 1), want.flatten())
                    loss.backward()
                    total += float(loss.detach())
                h.backward(hd.grad)
                losses.append(total)
            _same_loss(f"raf={raf} step {step}", *losses)
            pair.check(f"raf={raf} step {step}")
            ours, theirs = pair.counts()
            # Three units gathered for the root's forward (and again for h's backward
            # once resharded), the head once per chunk (twice under raf=True: forward
            # and backward); each backward reduces what it reached: 3 head chunks + 3.
            # The head's chunk backward prefetches nothing ([Note: a unit run outside
            # the root's forward]); FSDP2 gathers once more under raf=True (13, 6).
            want = (12, 6) if raf else (9, 6)
            assert ours == want and ours[1] == theirs[1] and ours[0] <= theirs[0], (
                f"rank {dist.get_rank()} raf={raf} step {step}: (all-gathers, reduce-scatters) "
                f"{ours} (cadence, want {want}) vs {theirs} (FSDP2)"
            )
            _step(opts)
        pair.check(f"raf={raf} end", grads=False)


# -- 7. which tensors the modules hold; conversions between microbatches -------------------------


def _kinds(m: nn.Module) -> dict[str, str]:
    return {n: type(p).__name__ for n, p in m.named_parameters()}


def registered_parameters_after_forward_and_backward_match_fsdp2(raf: bool) -> None:
    """torch's ``test_param_registration_after_forward`` / ``_after_backward``: after a
    forward the modules hold sharded DTensors (raf True) or the plain unsharded
    parameters with the full values (raf False); after backward, DTensors again;
    ``reshard()`` after a forward restores them. The same kinds as FSDP2 each time."""
    rank = dist.get_rank()

    def apply(m: nn.Module, shard: Shard) -> None:
        shard(m[0], raf)
        shard(m[2], raf)
        shard(m, raf)

    torch.manual_seed(18)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, 3))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    with _Pair(model, apply) as pair:
        x = _local(_batch(0))
        for phase in ("forward", "backward", "reshard"):
            for m in (pair.ours, pair.theirs):
                if phase == "reshard":
                    with torch.no_grad():
                        m(x)
                    for u in (m[0], m[2], m):
                        u.reshard()
                elif phase == "forward":
                    out = m(x)
                else:
                    m(x).sum().backward()
            kinds = [_kinds(m) for m in (pair.ours, pair.theirs)]
            assert kinds[0] == kinds[1], (
                f"rank {rank} raf={raf} after {phase}: {kinds[0]} vs FSDP2 {kinds[1]}"
            )
            want = "Parameter" if phase == "forward" and not raf else "DTensor"
            assert set(kinds[0].values()) == {want}, (
                f"rank {rank} raf={raf} after {phase}: {kinds[0]}"
            )
            if want == "Parameter":
                seen = {n: p.detach() for n, p in pair.ours.named_parameters()}
                assert max_abs_diff(seen, full) == 0.0, f"rank {rank}: unsharded values differ"
                for m in (pair.ours, pair.theirs):
                    out = m(x)
                    out.sum().backward()  # finish the step the forward began
                    m.zero_grad()


def a_no_op_conversion_between_microbatches_keeps_the_accumulation() -> None:
    """torch's ``test_no_op_conversion_preserves_pending_grad``: ``model.float()`` on an
    fp32 model between a no-sync microbatch and the synced one keeps the unsharded
    accumulation: gradients equal FSDP2's and those of the same steps without it."""

    def run(convert: bool) -> dict[str, torch.Tensor | None]:
        with _Pair(_mlp(19), _shard_linears) as pair:
            for mb in range(2):
                for m in (pair.ours, pair.theirs):
                    m.set_requires_gradient_sync(mb == 1)
                x = _local(_batch(mb))
                pair.backward(f"convert={convert} mb {mb}", lambda m, x=x: m(x).sum())
                if convert and mb == 0:
                    for m in (pair.ours, pair.theirs):
                        m.float()
            pair.check(f"convert={convert}")
            return _full_grads(pair.ours)

    _same("grads with a no-op float() between microbatches", run(True), run(False))


def a_tensor_parallel_parameter_is_refused_by_name() -> None:
    """torch's ``test_2d_mlp_with_nd_mesh`` / ``test_3d_mlp_with_nd_mesh`` compose tensor
    parallelism with FSDP2. cadence does not: a parameter that ``parallelize_module``
    made a DTensor is refused naming tensor parallelism and the fix (it used to say
    "fully_shard applied twice?")."""
    torch.manual_seed(20)
    model = nn.Sequential(nn.Linear(DIM, DIM))
    parallelize_module(model, _mesh(), {"0": ColwiseParallel()})
    assert_raises(
        lambda: cadence_fully_shard(model),
        "'0.weight'",
        "tensor parallelism",
        "torch's fully_shard for TP + FSDP",
        kind=FullyShardError,
    )


class _RootParam(nn.Module):
    """torch's lazy-init test model: a root parameter beside two child units."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.empty(DIM))
        self.lin1 = nn.Linear(DIM, DIM)
        self.lin2 = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x) + self.p))


def a_root_parameter_replaced_on_a_meta_model_matches_fsdp2() -> None:
    """torch's ``test_reset_sharded_param_in_lazy_init``: on a meta model, only the
    children get ``to_empty``, and the root's parameter is replaced by assignment
    (``model.p = nn.Parameter(<a DTensor sharded as before>)``) after ``fully_shard``;
    forward and backward then train as under FSDP2 (losses, gradients, kinds)."""
    rank = dist.get_rank()
    models = []
    for lib in ("cadence", "FSDP2"):
        with torch.device("meta"):
            m = _RootParam()
        for child in (m.lin1, m.lin2, m):
            if lib == "cadence":
                cadence_fully_shard(child)
            else:
                torch_fully_shard(child, mesh=_mesh())
        for child in (m.lin1, m.lin2):
            child.to_empty(device="cpu")
            torch.manual_seed(21)
            child.reset_parameters()
        torch.manual_seed(22)
        # As torch's test: the new parameter is sharded as the old one was.
        m.p = nn.Parameter(distribute_tensor(torch.randn(DIM), _mesh(), [Shard0(0)]))
        models.append(m)
    x = _local(_batch(0))
    losses = []
    for m in models:
        loss = m(x).sum()
        loss.backward()
        losses.append(float(loss.detach()))
    _same_loss("after replacing the root parameter", *losses)
    _same("grads", *(_full_grads(m) for m in models))
    kinds = [_kinds(m) for m in models]
    assert kinds[0] == kinds[1], f"rank {rank}: {kinds[0]} vs FSDP2 {kinds[1]}"


SCENARIOS = [
    *cases(clipping_with_each_norm_type_matches_fsdp2, "norm", ["1", "2", "inf"]),
    *cases(a_gradient_scaler_skips_a_step_with_inf_on_one_rank_as_fsdp2, "has_inf", [True, False]),
    *scenarios(
        a_registered_forward_method_trains_as_fsdp2, registering_a_forward_method_checks_its_name
    ),
    *cases(accumulation_flags_on_some_units_match_fsdp2, "mode", ["root_only", "some_mlps"]),
    *scenarios(
        every_unit_unsharded_up_front_matches_fsdp2,
        slicing_a_sharded_sequential_gives_a_plain_sequential,
        a_channels_last_parameter_is_refused_as_fsdp2,
        a_parameters_grad_dtype_is_kept_as_fsdp2,
        differing_grad_dtypes_in_one_unit_are_refused,
    ),
    *cases(a_head_run_per_chunk_outside_the_root_matches_fsdp2, "raf", [True, False]),
    *cases(registered_parameters_after_forward_and_backward_match_fsdp2, "raf", [True, False]),
    *scenarios(
        a_no_op_conversion_between_microbatches_keeps_the_accumulation,
        a_tensor_parallel_parameter_is_refused_by_name,
        a_root_parameter_replaced_on_a_meta_model_matches_fsdp2,
    ),
]
