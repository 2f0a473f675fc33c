"""Scenarios for parity: cadence against single-process training and torch DDP.

`SCENARIOS` (one per world-2 configuration) runs in the world-2 launch;
`OTHER_WORLDS` runs alone at world sizes 1, 3 and 4.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import cadence
from cadence.testing import max_abs_diff, named_grads, named_params
from tests._scenarios import Scenario, cases, scenarios
from tests.data_parallel.common import global_batch, local, make_mlp, strip

# The world-2 parity configurations (other world sizes run a subset).
CONFIGS = {
    "auto": {},
    "manual": {"mode": "manual"},
    "async": {"mode": "async"},
    "tiny_buckets": {"dp": {"bucket_cap_mb": 1e-5}},
    "tiny_buckets_async": {"mode": "async", "dp": {"bucket_cap_mb": 1e-5}},
    "one_huge_bucket": {"dp": {"bucket_cap_mb": 1000.0}},
    "bucket_view": {"dp": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001}},
    "bucket_view_zero_grad": {
        "dp": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001},
        "set_to_none": False,
    },
    "find_unused_all_used": {"dp": {"find_unused_parameters": True, "bucket_cap_mb": 0.001}},
}


def _parity(config: dict[str, Any]) -> dict[str, float]:
    """Train 3 AdamW steps with cadence, the single-process reference and (optionally) torch DDP.

    Returns the worst gradient / parameter differences against each oracle.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mode = config.get("mode", "auto")
    dp_kwargs = dict(config.get("dp", {}))
    model = make_mlp(config.get("seed", 0))
    ref = copy.deepcopy(model)
    dp = cadence.DataParallel(copy.deepcopy(model), **dp_kwargs)
    if mode != "auto":
        dp.require_manual_backward_finalization = True
    opt = torch.optim.AdamW(dp.parameters(), lr=1e-2)
    dp.register_optimizer(opt)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ddp = ddp_opt = None
    if config.get("ddp", True):
        ddp_kwargs = {
            k: v
            for k, v in dp_kwargs.items()
            if k in ("bucket_cap_mb", "gradient_as_bucket_view", "find_unused_parameters")
        }
        ddp = DDP(copy.deepcopy(model), **ddp_kwargs)
        ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    out = {"grad_ref": 0.0, "grad_ddp": 0.0, "param_ref": 0.0, "param_ddp": 0.0}
    for step in range(3):
        x, y = global_batch(step, world)
        xl, yl = local(x, rank, world), local(y, rank, world)

        opt.zero_grad(set_to_none=config.get("set_to_none", True))
        loss = F.mse_loss(dp(xl), yl)
        loss.backward()
        if mode == "manual":
            dp.finalize_backward()
        elif mode == "async":
            handle = dp.finalize_backward(async_op=True)
            assert handle is not None
            torch.randn(64, 64) @ torch.randn(64, 64)  # independent work while in flight
            handle.wait()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        g = strip(named_grads(dp))
        gr = named_grads(ref)
        out["grad_ref"] = max(out["grad_ref"], max_abs_diff(g, gr))
        if ddp is not None:
            ddp_opt.zero_grad()
            F.mse_loss(ddp(xl), yl).backward()
            out["grad_ddp"] = max(out["grad_ddp"], max_abs_diff(g, strip(named_grads(ddp))))
            ddp_opt.step()
        opt.step()
        ref_opt.step()
    p = strip(named_params(dp))
    out["param_ref"] = max_abs_diff(p, named_params(ref))
    if ddp is not None:
        out["param_ddp"] = max_abs_diff(p, strip(named_params(ddp)))
    out["num_buckets"] = float(dp.num_buckets)
    return out


def _assert_parity(config: dict[str, Any]) -> None:
    r = _parity(config)
    for key in ("grad_ref", "param_ref", "grad_ddp", "param_ddp"):
        assert r[key] < 1e-6, f"{key} = {r[key]:.3e} (all: {r})"


def matches_single_process_and_ddp(config: str) -> None:
    """3 AdamW steps give the gradients and parameters of one process and of torch DDP."""
    _assert_parity(CONFIGS[config])


def tiny_buckets_really_split() -> None:
    # 5 Linear layers = 10 params, each above the 10-byte cap but the head's bias (one
    # float): packed from the last layer, that bias shares the head weight's bucket,
    # and every other parameter has one of its own.
    tiny = _parity(CONFIGS["tiny_buckets"])["num_buckets"]
    assert tiny == 9, f"{tiny} buckets under a 10-byte cap"
    huge = _parity(CONFIGS["one_huge_bucket"])["num_buckets"]
    assert huge == 1, f"{huge} buckets under a 1000 MB cap"


SCENARIOS = [
    *cases(matches_single_process_and_ddp, "config", sorted(CONFIGS)),
    *scenarios(tiny_buckets_really_split),
]

# World sizes 1, 3 and 4 run a subset.
OTHER_CONFIGS = {"auto": {}, "async_tiny": {"mode": "async", "dp": {"bucket_cap_mb": 0.001}}}
OTHER_WORLDS = [
    Scenario(f"matches_single_process_and_ddp-{name}", _assert_parity, {"config": config})
    for name, config in OTHER_CONFIGS.items()
]


# -- higher-order gradients ---------------------------------------------------------
# A gradient penalty first differentiates the output with respect to the *input*
# (autograd.grad, create_graph=True), a backward that computes no parameter gradient,
# then backpropagates the penalty through that graph into the parameters. torch DDP
# reduces only the backward that reaches the parameters; so must cadence. A
# backward(create_graph=True) leaves gradients that carry a graph, reduced values in
# them, as DDP's. torch DDP itself raises on this MLP under create_graph ("a leaf
# Variable that requires grad is being used in an in-place operation", torch 2.15);
# its one create_graph test (a scalar parameter) runs against cadence in
# test_torch_ddp_suite, so here the create_graph form is judged by one process alone.
PENALTY_FORMS = ("penalty_alone", "penalty_plus_loss", "create_graph")


def _higher_order_backward(model: Any, x: torch.Tensor, y: torch.Tensor, form: str) -> None:
    if form == "create_graph":
        F.mse_loss(model(x), y).backward(create_graph=True)
        return
    x = x.clone().requires_grad_(True)
    out = model(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    penalty = (gx.norm(dim=1) - 1).pow(2).mean()
    (penalty if form == "penalty_alone" else F.mse_loss(out, y) + penalty).backward()


def higher_order_gradients_match_ddp(form: str, mode: str) -> None:
    """A gradient penalty or a create_graph backward reduces as torch DDP and one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_mlp(3)
    # Without the last bias every parameter shapes d out / d x, so the penalty alone
    # reaches them all (the last bias would get no gradient: unused, for DDP too).
    model[-1].bias = None
    ref, ddp = copy.deepcopy(model), DDP(copy.deepcopy(model))
    dp = cadence.DataParallel(copy.deepcopy(model))
    dp.require_manual_backward_finalization = mode == "manual"
    with_ddp = form != "create_graph"
    for step in range(3):
        x, y = global_batch(step, world)
        xl, yl = local(x, rank, world), local(y, rank, world)
        for m in (dp, ddp, ref):
            m.zero_grad(set_to_none=True)
        _higher_order_backward(dp, xl, yl, form)
        if mode == "manual":
            dp.finalize_backward()
        if with_ddp:
            _higher_order_backward(ddp, xl, yl, form)
        # One process on the global batch: every loss is a mean over equal local batches.
        _higher_order_backward(ref, x, y, form)
        g, gr = strip(named_grads(dp)), named_grads(ref)
        oracles = [("one process", gr)] + ([("DDP", strip(named_grads(ddp)))] if with_ddp else [])
        for oracle, other in oracles:
            assert set(g) == set(other), f"rank {rank}: grads of {set(g)} vs {oracle} {set(other)}"
            diff = max_abs_diff(g, other)
            assert diff < 1e-6, f"rank {rank} step {step} {form}/{mode}: vs {oracle} {diff:.3e}"
        carries = {n: p.grad.requires_grad for n, p in dp.module.named_parameters()}
        expected = {n: p.grad.requires_grad for n, p in ref.named_parameters()}
        assert carries == expected, f"rank {rank}: grad requires_grad {carries} vs {expected}"
        with torch.no_grad():
            for m in (dp, ddp, ref) if with_ddp else (dp, ref):
                for p in m.parameters():
                    p -= 0.1 * p.grad


HIGHER_ORDER = [
    Scenario(
        f"higher_order_gradients_match_ddp-{form}-{mode}",
        higher_order_gradients_match_ddp,
        {"form": form, "mode": mode},
    )
    for form in PENALTY_FORMS
    for mode in ("auto", "manual")
]
SCENARIOS += HIGHER_ORDER
