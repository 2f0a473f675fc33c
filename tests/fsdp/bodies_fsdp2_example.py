"""Rank body: ``fsdp2_example.py`` under torch's ``fully_shard`` and, imports switched, cadence's.

Each rank writes the script's two variants (the second differs only in its FSDP2
import line), runs both, and compares what they saved: its own per-rank files, and
on rank 0 the two distributed checkpoints, gathered to full tensors.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["CADENCE_IMPORTS", "TORCH_IMPORTS", "fsdp2_example", "switch_imports"]

EXAMPLE = Path(__file__).with_name("fsdp2_example.py")
TORCH_IMPORTS = "from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard\n"
# isinstance(m, FSDPModule) is False for cadence's modules by design (docs/fsdp.md,
# "isinstance and torch's FSDPModule"): the swap names cadence's class for it.
CADENCE_IMPORTS = (
    "from cadence.fsdp import FullyShardedModule as FSDPModule, MixedPrecisionPolicy, fully_shard\n"
)


def switch_imports(source: str) -> str:
    """The script with its one FSDP2 import line replaced by cadence's; nothing else."""
    if source.count(TORCH_IMPORTS) != 1:
        raise AssertionError(f"{EXAMPLE.name} must import FSDP2 in exactly one line")
    return source.replace(TORCH_IMPORTS, CADENCE_IMPORTS)


def _run(directory: Path, variant: str) -> dict[str, list[float]]:
    source = EXAMPLE.read_text()
    if variant == "cadence":
        source = switch_imports(source)
    script = directory / f"{variant}_example.{dist.get_rank()}.py"
    script.write_text(source)
    spec = importlib.util.spec_from_file_location(f"{variant}_fsdp2_example", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    result: dict[str, list[float]] = module.main(str(directory / variant))
    return result


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists to ``{path: leaf}``; DTensors as this rank's shard."""
    if isinstance(obj, dict):
        return {
            k: v for key, val in obj.items() for k, v in _flatten(val, f"{prefix}{key}/").items()
        }
    if isinstance(obj, (list, tuple)):
        return {
            k: v for i, val in enumerate(obj) for k, v in _flatten(val, f"{prefix}{i}/").items()
        }
    return {prefix: obj.to_local() if isinstance(obj, DTensor) else obj}


def _unequal(a: Any, b: Any) -> list[str]:
    """The paths where two saved objects differ (bitwise for tensors)."""
    fa, fb = _flatten(a), _flatten(b)
    if fa.keys() != fb.keys():
        return [f"keys: {sorted(fa.keys() ^ fb.keys())}"]
    out = []
    for key, x in fa.items():
        y = fb[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        else:
            same = x == y
        if not same:
            out.append(key)
    return out


def _dcp_unequal(directory: Path) -> list[str]:
    """The two distributed checkpoints gathered to plain full tensors, compared."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = {}
    for variant in ("torch", "cadence"):
        target = directory / f"{variant}_dcp.pt"
        dcp_to_torch_save(directory / variant / "dcp", target)
        saved[variant] = torch.load(target)
    return _unequal(saved["torch"], saved["cadence"])


def fsdp2_example(directory: str) -> dict[str, Any]:
    root = Path(directory)
    rank = dist.get_rank()
    out: dict[str, Any] = {variant: _run(root, variant) for variant in ("torch", "cadence")}
    for name in ("model", "optim"):
        files = [
            torch.load(root / variant / f"{name}.{rank}.pt") for variant in ("torch", "cadence")
        ]
        out[f"{name}_file_unequal"] = _unequal(*files)
    dist.barrier()
    out["dcp_unequal"] = _dcp_unequal(root) if rank == 0 else []
    return out
