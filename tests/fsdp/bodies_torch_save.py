"""Rank body: ``torch.save`` / ``torch.load`` of a fully_shard model and its optimizer.

Each rank saves its own shards the plain way, a differently initialised model and a
fresh optimizer load them, and both copies then train on: every number must match
exactly (parameters, optimizer state, and the parameters after more steps, which
shows the momentum survived). The body returns the distances; the test asserts them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import cadence
from cadence.testing import max_abs_diff
from tests._outcome import recorded
from tests.fsdp.common import TinyTransformer, apply_cadence, full_params, loss_fn, make_batches

__all__ = ["torch_save_body", "torch_save_cases"]


def _local(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _local(v).items()})
        elif isinstance(v, DTensor):
            out[k] = v.to_local()
        elif isinstance(v, torch.Tensor):
            out[k] = v
    return out


def _build(mp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = TinyTransformer()
    policy = cadence.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else None
    apply_cadence(m, m.units(), mp_policy=policy)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for b in batches:
        loss_fn(m, b.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()


def torch_save_body(directory: str, mp: bool, with_dcp: bool) -> dict[str, float | str]:
    rank = dist.get_rank()
    batches = make_batches("tokens", 4, 6)
    m, opt = _build(mp)
    _train(m, opt, batches[:2])
    path = Path(directory) / f"mp{int(mp)}_dcp{int(with_dcp)}"
    path.mkdir(exist_ok=True)
    torch.save(m.state_dict(), path / f"model.{rank}.pt")
    torch.save(opt.state_dict(), path / f"optim.{rank}.pt")

    other, other_opt = _build(mp)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)  # differs from the saved model until the load
    before = max_abs_diff(full_params(other), full_params(m))
    other.load_state_dict(torch.load(path / f"model.{rank}.pt", weights_only=False))
    other_opt.load_state_dict(torch.load(path / f"optim.{rank}.pt", weights_only=False))
    out: dict[str, float | str] = {
        "differs_before_load": before,
        "model_sd": max_abs_diff(_local(other.state_dict()), _local(m.state_dict())),
        "optim_sd": max_abs_diff(_local(other_opt.state_dict()), _local(opt.state_dict())),
        "tied": float(other.head.weight is other.emb.weight),
    }
    _train(m, opt, batches[2:])
    _train(other, other_opt, batches[2:])
    out["after_training"] = max_abs_diff(full_params(other), full_params(m))
    if with_dcp:
        out.update(_dcp_round_trip(m, opt, mp, path, batches))
    # The plain default (weights_only=True) reads it too, as for torch's FSDP2.
    out["weights_only_vs_full_load"] = recorded(_weights_only_vs_full, path / f"model.{rank}.pt")
    return out


def _weights_only_vs_full(file: Path) -> float:
    """How far ``torch.load``'s default (``weights_only=True``) reading of ``file`` is from
    the full unpickler's; a key it lacks raises (a KeyError)."""
    full = _local(torch.load(file, weights_only=False))
    return max_abs_diff(full, _local(torch.load(file)))


def _dcp_round_trip(
    m: torch.nn.Module, opt: torch.optim.Optimizer, mp: bool, path: Path, batches: Any
) -> dict[str, float]:
    """The documented checkpoint code: torch.distributed.checkpoint and its state_dict API."""
    # Imported here: torch.distributed.checkpoint takes seconds to import.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )

    out: dict[str, float] = {}
    dcp_model, dcp_opt = _build(mp)
    model_sd, optim_sd = get_state_dict(m, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
    model_sd, optim_sd = get_state_dict(dcp_model, dcp_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(
        dcp_model, dcp_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    out["dcp_optim_sd"] = max_abs_diff(_local(dcp_opt.state_dict()), _local(opt.state_dict()))
    # A full (gathered) state dict, as for a single-process consumer.
    full = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
    out["full_sd"] = max_abs_diff(full, m.full_state_dict())
    _train(m, opt, batches[2:3])
    _train(dcp_model, dcp_opt, batches[2:3])
    out["dcp_after_training"] = max_abs_diff(full_params(dcp_model), full_params(m))
    return out


def torch_save_cases(
    directory: str, cases: list[tuple[bool, bool]]
) -> list[dict[str, float | str]]:
    """Several (mixed precision, with DCP) cases in one launch."""
    return [torch_save_body(directory, mp, with_dcp) for mp, with_dcp in cases]
