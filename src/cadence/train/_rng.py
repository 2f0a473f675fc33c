"""Every rank's RNG states in a checkpoint, stored without pickle.

Rank ``r`` saves, as DCP items of its own:

- ``rng/rank<r>/torch``: the CPU generator's state, the uint8 tensor torch returns;
- ``rng/rank<r>/cuda``: with CUDA in use, every device's state stacked (uint8);
- ``rng/rank<r>/json``: ``random``'s state (ints and one float) and, when numpy is
  imported, numpy's (its key as ints, the position, the cached gaussian), as the
  UTF-8 bytes of a JSON document in a uint8 tensor.

DCP writes tensors as raw data and reads them back with torch's weights-only loader,
and JSON describes data only, so restoring these states runs nothing from the
folder. Their shapes come from DCP's metadata, read once the checkpoint is verified
(see [Note: a checkpoint is verified before anything in it is unpickled] in
``checkpoint.py``); any other kind of item under a rank's ``rng/`` name (a pickled
object, as an older cadence wrote) is refused, never loaded.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from cadence.train._errors import CheckpointError, ResumeRefusedError

__all__ = ["restore_rng", "rng_placeholders", "rng_state_dict"]


def _prefix(rank: int) -> str:
    return f"rng/rank{rank}/"


def _encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)


def rng_state_dict(rank: int) -> dict[str, torch.Tensor]:
    """This rank's RNG states, as the DCP items ``rng/rank<rank>/*``."""
    p = _prefix(rank)
    out = {f"{p}torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"{p}cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    version, internal, gauss = random.getstate()
    doc: dict[str, Any] = {"python": [version, list(internal), gauss]}
    if "numpy" in sys.modules:
        name, key, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        doc["numpy"] = [name, [int(k) for k in key], int(pos), int(has_gauss), float(cached)]
    out[f"{p}json"] = _encode(json.dumps(doc))
    return out


def rng_placeholders(metadata: Metadata, rank: int) -> dict[str, torch.Tensor]:
    """Empty tensors for every ``rng/rank<rank>/*`` item the checkpoint holds, for
    `dcp.load` to fill. Raises `ResumeRefusedError` for an item that is not a uint8
    tensor, or when the torch or JSON state is missing."""
    p = _prefix(rank)
    out = {}
    for key, item in metadata.state_dict_metadata.items():
        if key != p.rstrip("/") and not key.startswith(p):
            continue
        if not isinstance(item, TensorStorageMetadata) or item.properties.dtype != torch.uint8:
            raise ResumeRefusedError(
                f"the checkpoint's {key} is a {type(item).__name__}, not one of the uint8 "
                "tensors cadence stores RNG states as (a pickled object is never loaded): "
                "start over with --overwrite, or resume from a checkpoint cadence wrote"
            )
        out[key] = torch.empty(item.size, dtype=torch.uint8)
    if f"{p}torch" not in out or f"{p}json" not in out:
        raise ResumeRefusedError(
            f"the checkpoint holds no RNG states for rank {rank} ({p}torch, {p}json), "
            "though it was saved by that many ranks: start over with --overwrite"
        )
    return out


def _ints(value: object, n: int | None = None) -> list[int]:
    if not isinstance(value, list) or (n is not None and len(value) != n):
        raise ValueError(f"expected a list of {n or 'some'} ints")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError("expected ints")
    return value


def restore_rng(sd: dict[str, Any], rank: int) -> None:
    """Set this rank's RNG states from the items `rng_placeholders` made and DCP filled."""
    p = _prefix(rank)
    try:
        doc = json.loads(bytes(sd[f"{p}json"].tolist()).decode("utf-8"))
        version, internal, gauss = doc["python"]
        if not isinstance(gauss, (float, type(None))):
            raise ValueError("the cached gaussian is not a float")
        python_state = (version, tuple(_ints(internal, 625)), gauss)
        torch.set_rng_state(sd[f"{p}torch"])
        random.setstate(python_state)
        if f"{p}cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(sd[f"{p}cuda"].unbind(0)))
        if "numpy" in doc:
            import numpy

            name, key, pos, has_gauss, cached = doc["numpy"]
            numpy.random.set_state(
                (name, numpy.array(_ints(key, 624), dtype=numpy.uint32), pos, has_gauss, cached)
            )
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"rank {rank}'s RNG states in the checkpoint are unreadable ({exc}); its "
            "content matched the manifest, so the cadence that wrote it stores them "
            "otherwise: resume with that cadence, or start over with --overwrite"
        ) from exc
