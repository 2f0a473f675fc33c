"""``cadence train --export DIR``: the trained weights as a file that others read.

[Note: exporting without holding the model]
A run's checkpoints are cadence's own (DCP shards, a signed manifest); a user who
takes the weights away wants a plain ``name -> tensor`` file. The export writes one
``safetensors`` file with the unwrapped model's ``state_dict`` names (a tied weight
once, under its first name), whatever the layout: DataParallel, fully_shard, HSDP or
a pipeline. For a ``transformers`` model (``--model hf:...``) the folder is also that
model's own ``save_pretrained`` layout (``config.json`` and ``model.safetensors`` with
its names), which ``from_pretrained`` loads on one process without cadence.

No rank holds more than one parameter's full tensor beyond its shard. The file's
header is written first, from the names, shapes and dtypes every rank knows (each
built the whole model before wrapping it); then the entries follow one at a time, in
the header's order. A sharded entry is gathered by its stage's data-parallel ranks
(``full_tensor()``), the lowest of which (the entry's *source*) sends it to rank 0
when rank 0 is in another pipeline position; rank 0 appends its bytes and drops it.
The file is written under a temporary name and renamed when complete, so an export
that fails leaves no half-written file behind.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from cadence.comm import Comm
from cadence.errors import CadenceRuntimeError
from cadence.models.hf import HFCausalLM
from cadence.topology import ParallelGroups

__all__ = ["ExportPlan", "export_weights", "safetensors_header"]

WEIGHTS = "model.safetensors"

# safetensors' names for torch dtypes (its format specification).
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

Entry = tuple[str, tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class ExportPlan:
    """What the exported file holds, in order, and how a rank finds each entry.

    Made from the unwrapped model on every rank, before any wrapper or pipeline split:
    ``entries`` are its ``state_dict`` names (a tied tensor once), shapes and dtypes;
    ``module_names`` maps each of its modules (by identity, which wrapping and
    splitting keep) to its name, so a stage's or a wrapper's tensors find theirs.
    ``strip``: a prefix the file's names drop (a ``transformers`` model's adapter).
    """

    entries: tuple[Entry, ...]
    module_names: dict[int, str]
    strip: str = ""
    hf_config: Any = None  # a transformers model's config: its folder gets config.json

    @staticmethod
    def of(model: nn.Module) -> ExportPlan:
        hf: Any = model.model if isinstance(model, HFCausalLM) else None  # a transformers model
        seen: set[int] = set()
        entries: list[Entry] = []
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue  # a tied tensor: saved once, under its first name
            seen.add(id(t))
            entries.append((name, tuple(t.shape), t.dtype))
        names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        if hf is None:
            return ExportPlan(tuple(entries), names)
        # The adapter's own name goes: the file's names are the transformers model's;
        # and the config names the class, as save_pretrained records it for from_pretrained.
        hf.config.architectures = [type(hf).__name__]
        return ExportPlan(tuple(entries), names, strip="model.", hf_config=hf.config)

    def local(self, roots: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
        """The entries this rank holds (whole, or as DTensor shards), by name."""
        wanted = {name for name, _, _ in self.entries}
        out: dict[str, torch.Tensor] = {}
        for root in roots:
            for m in root.modules():
                prefix = self.module_names.get(id(m))
                if prefix is None:
                    continue  # a wrapper's own module (DataParallel), not the model's
                for attr, t in [*m._parameters.items(), *m._buffers.items()]:
                    key = f"{prefix}.{attr}" if prefix else attr
                    if t is not None and key in wanted:
                        out[key] = t
        return out

    def file_name(self, name: str) -> str:
        return name.removeprefix(self.strip)


def safetensors_header(entries: Iterable[Entry], metadata: dict[str, str]) -> bytes:
    """The header of a safetensors file holding ``entries`` in this order, padded.

    The format: an 8-byte little-endian length, then that many bytes of JSON naming
    each tensor's dtype, shape and byte range in the data that follows (padded with
    spaces to 8 bytes, as safetensors itself writes it).
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype in entries:
        if dtype not in _DTYPES:
            raise CadenceRuntimeError(
                f"--export: '{name}' has dtype {dtype}, which safetensors has no name for"
            )
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def export_weights(
    plan: ExportPlan,
    roots: list[nn.Module],
    groups: ParallelGroups,
    out_dir: str | Path,
) -> Path | None:
    """Write the weights to ``out_dir`` (see [Note: exporting without holding the
    model]). Collective: every rank calls it. Returns the file's path on rank 0."""
    local = plan.local(roots)
    rank = groups.rank
    world = Comm(groups.world, name="export")
    source = Comm(groups.dp, name="export-dp").rank == 0  # the lowest replica of its stage
    owners = _owners(world, plan, local if source else {})
    out = Path(out_dir)
    tmp = out / f".{WEIGHTS}.partial"
    f: BinaryIO | None = None
    try:
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            f = tmp.open("wb")
            entries = [(plan.file_name(n), s, d) for n, s, d in plan.entries]
            f.write(safetensors_header(entries, {"format": "pt"}))
        for name, shape, dtype in plan.entries:
            t = local.get(name)
            full: torch.Tensor | None = None
            if t is not None:
                full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
                if rank != 0 and source:
                    world.isend(full.contiguous(), 0).wait()
            if rank == 0:
                if full is None:
                    assert owners is not None  # rank 0 made the map
                    full = torch.empty(shape, dtype=dtype, device=groups.device)
                    world.irecv(full, owners[name]).wait()
                assert f is not None
                f.write(_bytes(full))
            del full  # one full tensor at a time
        if f is not None:
            f.close()
            f = None
            os.replace(tmp, out / WEIGHTS)
            if plan.hf_config is not None:
                plan.hf_config.save_pretrained(out)  # config.json: from_pretrained's other half
    finally:
        if f is not None:
            f.close()
        if rank == 0 and tmp.exists():
            tmp.unlink()
    return out / WEIGHTS if rank == 0 else None


def _owners(comm: Comm, plan: ExportPlan, held: dict[str, torch.Tensor]) -> dict[str, int] | None:
    """On rank 0, the rank that sends each entry; refuses an entry nobody holds."""
    got = comm.gather_bytes(json.dumps(sorted(held)).encode(), dst=0)
    if got is None:
        return None
    owners: dict[str, int] = {}
    for r, raw in enumerate(got):
        for name in json.loads(raw):
            owners.setdefault(name, r)
    missing = [n for n, _, _ in plan.entries if n not in owners]
    if missing:
        raise CadenceRuntimeError(
            f"--export: no rank holds {', '.join(missing[:5])}; the model's modules were "
            "replaced after it was built (the export finds tensors by their module)"
        )
    return owners
