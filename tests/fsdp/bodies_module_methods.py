"""Rank bodies: fully_shard on meta, and nn.Module methods applied to a sharded model.

Every case runs the same script on cadence's fully_shard, on torch's FSDP2 and (where
the method means the same there) on one process with the global batch, and returns
plain values: the per-rank losses, the gathered parameters' distance to the other
runs, what a run or a refused call raised (as text; ``None`` when it did not).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cadence.fsdp import FullyShardedModule, fully_shard
from cadence.testing import max_abs_diff, run_subtests
from tests._outcome import raised, recorded
from tests.fsdp.common import (
    Blocks,
    TinyTransformer,
    apply_cadence,
    apply_torch,
    full_params,
    make_batches,
    make_blocks,
    train_steps,
)

__all__ = ["METHODS", "MetaLM", "module_methods_body"]

STEPS = 3

# -- a model as torch's FSDP2 example builds it -----------------------------------


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, 3 * dim)
        self.w2 = nn.Linear(3 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.wo(torch.tanh(self.wq(self.attention_norm(x))))
        return h + self.w2(torch.relu(self.w1(self.ffn_norm(h))))

    def linears(self) -> list[nn.Linear]:
        return [self.wq, self.wo, self.w1, self.w2]


class MetaLM(nn.Module):
    """Embedding, layers, norm and an untied output (11 rows: uneven at world 2)."""

    def __init__(self, vocab: int = 11, dim: int = 8, n_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

    def init_weights(self) -> None:
        """In-place initialisation in torchtitan's style (random ops on the shards)."""
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers:
            for lin in layer.linears():
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.output.weight, std=0.5, a=-1.0, b=1.0)


def _shard_lm(model: MetaLM, impl: str) -> MetaLM:
    units: list[nn.Module] = list(model.layers)
    if impl == "cadence":
        apply_cadence(model, units)
    else:
        apply_torch(model, units)
    return model


def _reset_all(model: nn.Module, seed: int = 3) -> None:
    """torch's example: every module's reset_parameters(), after one seed."""
    torch.manual_seed(seed)
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def _lm_losses(model: nn.Module, rank: int, world: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for batch in make_batches("tokens", STEPS, 8):
        local = batch.chunk(world)[rank]
        logits = model(local[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 11), local[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _meta_init(init: str, rank: int, world: int) -> dict[str, Any]:
    """Meta model, fully_shard, to_empty, initialise: params and training vs FSDP2."""
    out: dict[str, Any] = {}
    runs = {}
    for impl in ("cadence", "fsdp2"):
        with torch.device("meta"):
            model = MetaLM()
        _shard_lm(model, impl)
        model.to_empty(device="cpu")
        if init == "reset_parameters":
            _reset_all(model)
        else:
            torch.manual_seed(3)
            model.init_weights()
        initial = full_params(model)
        runs[impl] = (initial, _lm_losses(model, rank, world), full_params(model))
    (c_init, c_losses, c_final), (t_init, t_losses, t_final) = runs["cadence"], runs["fsdp2"]
    out["init_vs_fsdp2"] = max_abs_diff(c_init, t_init)
    out["init_keys_match"] = sorted(c_init) == sorted(t_init)
    out["losses_vs_fsdp2"] = max_abs_diff(c_losses, t_losses)
    out["final_vs_fsdp2"] = max_abs_diff(c_final, t_final)
    out["losses"] = c_losses
    return out


def _meta_misuse(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with torch.device("meta"):
        model = MetaLM()
    _shard_lm(model, "cadence")
    idx = torch.zeros(2, 4, dtype=torch.long)
    out["forward_on_meta"] = raised(lambda: model(idx))
    half_meta = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    out["mixed_meta"] = raised(lambda: fully_shard(half_meta))
    # A sharded state dict loaded with assign=True materializes a meta model (FSDP2 too).
    torch.manual_seed(5)
    real = _shard_lm(MetaLM(), "cadence")
    with torch.device("meta"):
        target = MetaLM()
    _shard_lm(target, "cadence")
    target.load_state_dict(real.state_dict(), assign=True)
    out["assign_sharded_vs_source"] = max_abs_diff(full_params(target), full_params(real))
    out["assign_sharded_losses"] = max_abs_diff(
        _lm_losses(target, rank, world), _lm_losses(real, rank, world)
    )
    # A full (single-process) state dict: each rank keeps its rows.
    torch.manual_seed(5)
    plain = MetaLM()
    with torch.device("meta"):
        target = MetaLM()
    _shard_lm(target, "cadence")
    target.load_state_dict(plain.state_dict(), assign=True)
    out["assign_full_vs_source"] = max_abs_diff(full_params(target), full_params(plain))
    with torch.device("meta"):
        target = MetaLM()
    _shard_lm(target, "cadence")
    target.load_full_state_dict(plain.state_dict())
    out["load_full_vs_source"] = max_abs_diff(full_params(target), full_params(plain))
    return out


def _meta_tied(rank: int, world: int) -> dict[str, Any]:
    """The tiny transformer (embedding tied to the head, in the root unit) built on meta."""
    runs = {}
    for impl in ("cadence", "fsdp2"):
        with torch.device("meta"):
            model = TinyTransformer()
        (apply_cadence if impl == "cadence" else apply_torch)(model, model.units())
        model.to_empty(device="cpu")
        _reset_all(model)
        with torch.no_grad():
            model.pos.normal_(std=0.1)  # a bare Parameter: no module resets it
        initial = full_params(model)
        losses = train_steps(model, make_batches("tokens", STEPS, 8), rank, world)
        runs[impl] = (initial, losses, full_params(model), model.emb.weight is model.head.weight)
    (c_init, c_losses, c_final, c_tied), (t_init, t_losses, t_final, _) = (
        runs["cadence"],
        runs["fsdp2"],
    )
    return {
        "still_tied": c_tied,
        "init_vs_fsdp2": max_abs_diff(c_init, t_init),
        "losses_vs_fsdp2": max_abs_diff(c_losses, t_losses),
        "final_vs_fsdp2": max_abs_diff(c_final, t_final),
    }


# -- nn.Module methods after sharding ----------------------------------------------


def _reinit_inner(model: nn.Module) -> None:
    inner = model.blocks[0].lin  # a submodule of a unit, not a unit itself
    inner.to_empty(device="cpu")
    torch.manual_seed(3)
    inner.reset_parameters()


def _donor(impl: str) -> dict[str, Any]:
    """Another model's state dict (sharded like the target, or plain for one process)."""
    torch.manual_seed(7)
    donor = Blocks()
    if impl == "cadence":
        apply_cadence(donor, donor.units())
    elif impl == "fsdp2":
        apply_torch(donor, donor.units())
    return donor.state_dict()


METHODS: dict[str, Callable[[nn.Module, str], object]] = {
    "to_empty": lambda m, impl: (m.to_empty(device="cpu"), _reset_all(m)),
    "to_float64": lambda m, impl: m.to(torch.float64),
    "double": lambda m, impl: m.double(),
    "bfloat16_then_float": lambda m, impl: (m.bfloat16(), m.float()),
    "half": lambda m, impl: m.half(),
    "bfloat16": lambda m, impl: m.bfloat16(),
    "float": lambda m, impl: m.float(),
    "cpu": lambda m, impl: m.cpu(),
    "to_cpu": lambda m, impl: m.to("cpu"),
    "apply_clone": lambda m, impl: m._apply(lambda t: t.clone()),
    "submodule_apply": lambda m, impl: m.blocks[0].lin._apply(lambda t: t.clone()),
    "submodule_to_empty": lambda m, impl: _reinit_inner(m),
    "requires_grad_false": lambda m, impl: m.blocks[0].requires_grad_(False),
    "requires_grad_true": lambda m, impl: m.blocks[1].requires_grad_(True),
    "param_requires_grad_attr": lambda m, impl: setattr(m.head.weight, "requires_grad", False),
    "load_state_dict_assign": lambda m, impl: m.load_state_dict(_donor(impl), assign=True),
}


def _model(impl: str, method: str) -> nn.Module:
    model = make_blocks()
    if method == "requires_grad_true":
        model.blocks[1].requires_grad_(False)  # frozen when sharded, unfrozen after
    if impl == "cadence":
        apply_cadence(model, model.units())
    elif impl == "fsdp2":
        apply_torch(model, model.units())
    return model


def _steps(
    model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor], rank: int, world: int
) -> list[float]:
    dtype = model.head.bias.dtype
    losses = []
    for batch in batches:
        loss = model(batch.chunk(world)[rank].to(dtype)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _method_run(
    impl: str, method: str, after_a_step: bool, start: dict[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """One step (optional), the method, then STEPS steps.

    The optimizer predates the method, except after ``load_state_dict(assign=True)``,
    which torch documents as needing a new one. ``impl="single"`` is one process on
    the global batch that continues from ``start``: the values a sharded run's
    parameters showed right after the method (what the method made of them).
    """
    rank, world = (0, 1) if impl == "single" else (dist.get_rank(), dist.get_world_size())
    batches = make_batches("blocks", STEPS + 1, 8)
    model = _model(impl, method)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if after_a_step:
        _steps(model, opt, batches[:1], rank, world)
    METHODS[method](model, "plain" if impl == "single" else impl)
    if method == "load_state_dict_assign":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if start is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(start[name])
    before = full_params(model)
    losses = _steps(model, opt, batches[1:], rank, world)
    return {"losses": losses, "params": full_params(model), "before": before}


def _method_case(method: str, order: str) -> dict[str, Any]:
    """cadence and FSDP2 against one process continuing from their own post-method values."""
    after_a_step = order == "after_a_step"
    out: dict[str, Any] = {}
    runs: dict[str, Any] = {}
    for impl in ("cadence", "fsdp2"):
        try:
            run = _method_run(impl, method, after_a_step)
        except Exception as exc:  # recorded: FSDP2 supports fewer methods than cadence
            out[f"{impl}_raised"] = f"{type(exc).__name__}: {exc}"
            continue
        out[f"{impl}_raised"] = None
        runs[impl] = run
        single = _method_run("single", method, after_a_step, start=run["before"])
        out[f"{impl}_vs_single"] = max_abs_diff(run["params"], single["params"])
    if "cadence" in runs:
        cad = runs["cadence"]
        out["losses"] = cad["losses"]
        out["moved"] = max_abs_diff(cad["params"], cad["before"])
        if "fsdp2" in runs:
            out["losses_vs_fsdp2"] = max_abs_diff(cad["losses"], runs["fsdp2"]["losses"])
            out["params_vs_fsdp2"] = max_abs_diff(cad["params"], runs["fsdp2"]["params"])
    return out


def _refused(rank: int, world: int) -> dict[str, Any]:
    """A device the shard group cannot use is refused before anything changes."""
    out: dict[str, Any] = {}
    batches = make_batches("blocks", STEPS, 8)
    model = _model("cadence", "none")
    out["to_empty_cuda"] = raised(lambda: model.to_empty(device="cuda"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    untouched = _model("cadence", "none")
    ref_opt = torch.optim.SGD(untouched.parameters(), lr=0.1, momentum=0.9)
    out["after_refusal_vs_untouched"] = max_abs_diff(
        _steps(model, opt, batches, rank, world), _steps(untouched, ref_opt, batches, rank, world)
    )
    replaced = _model("cadence", "none")
    replaced.blocks[0].lin.weight = nn.Parameter(torch.zeros(3))
    out["wrong_shape"] = raised(lambda: replaced(batches[0]))
    return out


def _isinstance(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    model = _model("cadence", "none")
    return {
        "is_fsdp_module": isinstance(model, FSDPModule),
        "is_fully_sharded_module": isinstance(model, FullyShardedModule),
        "block_is_fully_sharded_module": isinstance(model.blocks[0], FullyShardedModule),
    }


def module_methods_body() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    out["meta"] = run_subtests(
        {"init": ["reset_parameters", "init_weights"]},
        lambda init: recorded(_meta_init, init, rank, world),
    )
    out["meta_misuse"] = recorded(_meta_misuse, rank, world)
    out["meta_tied"] = recorded(_meta_tied, rank, world)
    out["methods"] = run_subtests(
        {"method": list(METHODS), "order": ["before_training", "after_a_step"]},
        lambda method, order: recorded(_method_case, method, order),
    )
    out["refused"] = recorded(_refused, rank, world)
    out["isinstance"] = recorded(_isinstance, rank, world)
    return out
