"""Rank bodies: per-rank state dicts and DCP checkpoints move between torch FSDP2 and cadence.

Each case trains one library's model two steps, saves its model and optimizer state
dicts per rank (``torch.save``), loads both into a differently initialised model of
the other library, and trains both copies two more steps: the loaded values and the
losses after the switch must equal the run that never switched, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from cadence.fsdp import fully_shard
from cadence.testing import run_subtests
from tests.fsdp.common import TinyTransformer, loss_fn, make_batches

__all__ = ["cross_load"]

Build = Callable[[], tuple[nn.Module, torch.optim.Optimizer]]


def _build(lib: str, mesh: DeviceMesh | None = None, group: Any = None) -> Build:
    """A TinyTransformer sharded per layer and at the root by ``lib``, with AdamW."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        m = TinyTransformer()
        for layer in [*m.units(), m]:
            if lib == "torch":
                torch_fully_shard(layer, mesh=mesh)
            else:
                fully_shard(layer, mesh=mesh, group=group)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    return build


def _train(m: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for b in batches:
        loss = loss_fn(m, b.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(t: Any) -> Any:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same keys and bitwise-equal full tensors (collective: call on every rank)."""
    if a.keys() != b.keys():
        return False
    return all(torch.equal(_full(a[k]), _full(b[k])) for k in a)


def _optim_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    state = opt.state_dict()["state"]
    return {f"{i}.{k}": v for i, s in state.items() for k, v in s.items()}


def _switch(source: Build, target: Build, directory: Path) -> dict[str, Any]:
    """Train ``source``, save per rank, load into ``target``, train both on."""
    rank = dist.get_rank()
    batches = make_batches("tokens", 4, 6)
    m, opt = source()
    _train(m, opt, batches[:2])
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(m.state_dict(), directory / f"model.{rank}.pt")
    torch.save(opt.state_dict(), directory / f"optim.{rank}.pt")

    other, other_opt = target()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)  # differs from the saved model until the load
    out: dict[str, Any] = {"differs_before": not _bitwise_equal(other.state_dict(), m.state_dict())}
    other.load_state_dict(torch.load(directory / f"model.{rank}.pt"))
    other_opt.load_state_dict(torch.load(directory / f"optim.{rank}.pt"))
    out["model_equal"] = _bitwise_equal(other.state_dict(), m.state_dict())
    out["optim_equal"] = _bitwise_equal(_optim_state(other_opt), _optim_state(opt))
    out["losses_never_switched"] = _train(m, opt, batches[2:])
    out["losses_switched"] = _train(other, other_opt, batches[2:])
    out["after_training_equal"] = _bitwise_equal(other.state_dict(), m.state_dict())
    return out


def _error(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as exc:  # reported, not raised: the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _mismatched_layout(directory: Path) -> dict[str, str]:
    """A world-sharded torch file into a cadence model sharded over one rank each."""
    rank = dist.get_rank()
    m, opt = _build("torch")()
    _train(m, opt, make_batches("tokens", 1, 6))
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(m.state_dict(), directory / f"model.{rank}.pt")
    torch.save(opt.state_dict(), directory / f"optim.{rank}.pt")
    alone, _ = dist.new_subgroups(1)  # every rank its own shard group: other local rows
    other, other_opt = _build("cadence", group=alone)()
    out = {
        "model": _error(lambda: other.load_state_dict(torch.load(directory / f"model.{rank}.pt")))
    }
    other_opt.load_state_dict(torch.load(directory / f"optim.{rank}.pt"))
    out["optim_step"] = _error(other_opt.step)
    return out


def _dcp_switch(source: Build, target: Build, directory: Path) -> dict[str, Any]:
    """The documented DCP code: save under one library, load under the other."""
    import torch.distributed.checkpoint as dcp  # slow to import: only where used
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    batches = make_batches("tokens", 3, 6)
    m, opt = source()
    _train(m, opt, batches[:2])
    model_sd, optim_sd = get_state_dict(m, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory))
    other, other_opt = target()
    model_sd, optim_sd = get_state_dict(other, other_opt)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(
        other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return {
        "model_equal": _bitwise_equal(other.state_dict(), m.state_dict()),
        "optim_equal": _bitwise_equal(_optim_state(other_opt), _optim_state(opt)),
        "losses_equal": _train(other, other_opt, batches[2:]) == _train(m, opt, batches[2:]),
    }


def cross_load(directory: str) -> dict[str, Any]:
    root = Path(directory)
    world = dist.get_world_size()
    named = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sections: dict[str, Callable[[], Any]] = {
        "torch_to_cadence": lambda: _switch(_build("torch"), _build("cadence"), root / "t2c"),
        "cadence_to_torch": lambda: _switch(_build("cadence"), _build("torch"), root / "c2t"),
        # torch's mesh named ("dp",), cadence's the default (unnamed): not equal meshes.
        "named_torch_mesh": lambda: _switch(
            _build("torch", mesh=named), _build("cadence"), root / "named"
        ),
        "mismatched_layout": lambda: _mismatched_layout(root / "mismatch"),
        "dcp_torch_to_cadence": lambda: _dcp_switch(
            _build("torch"), _build("cadence"), root / "dcp_t2c"
        ),
        "dcp_cadence_to_torch": lambda: _dcp_switch(
            _build("cadence"), _build("torch"), root / "dcp_c2t"
        ),
    }
    results = run_subtests({"name": list(sections)}, lambda name: sections[name]())
    return {name: results[f"name={name!r}"] for name in sections}
