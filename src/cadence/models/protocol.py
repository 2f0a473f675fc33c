"""The block protocol: how a model tells cadence its repeated blocks and stage cuts.

A model that ``cadence train --model`` builds needs nothing from cadence to train under
DataParallel. Sharding (``--fsdp``) and pipelines (``--pp``) need to know its structure,
which the model declares with at most three attributes:

- ``cadence_blocks``: the repeated blocks, in forward order: the dotted name of an
  attribute holding an ``nn.ModuleList`` (``"layers"``, ``"model.layers"``), or a method
  that returns the blocks. Each block becomes one ``fully_shard`` unit. Needed by
  ``--fsdp``.
- ``split_stages(n) -> list[nn.Module]``: the model cut into ``n`` stages whose
  composition (each stage's output the next one's input) is the whole forward, as
  TinyGPT's and Llama's. Needed by ``--pp`` (unless the next attribute is given).
- ``cadence_stage_parts``: the attribute names of a model shaped ``parts before ->
  blocks -> parts after``, in forward order, with the blocks' name among them, e.g.
  ``("embed", "layers", "norm", "head")``: each part takes one tensor and returns one,
  so `split_by_parts` cuts the model generically (the first stage gets the parts
  before the blocks, the last stage the parts after them).

[Note: why the block protocol is three attributes]
cadence cannot find a model's blocks itself: a heuristic ("the longest ModuleList")
picks the wrong list in a model with two (an encoder's and a decoder's), and a wrong
fully_shard unit trains correctly but gathers far more than needed, which nothing would
report. So the model says it, by a name rather than a base class: a model from any
library can declare it (or a thin adapter can, as `cadence.models.hf` does), and a
model that does not is refused under ``--fsdp`` and ``--pp`` in one line naming the
attribute to add, never guessed at. Pipelines need more than the blocks: whatever runs
between them (an embedding, position ids, rotary tables, masks) must be inside a stage.
``split_stages`` lets a model cut itself however it likes; ``cadence_stage_parts``
covers the common shape without code, and refuses a model whose parts share
parameters (tied embeddings), which one stage cannot hold for another.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from torch import nn

from cadence.models._errors import BlockProtocolError

__all__ = [
    "BLOCKS",
    "PARTS",
    "SPLIT",
    "BlockProtocolError",
    "can_split",
    "model_blocks",
    "split_by_parts",
    "split_model",
]

BLOCKS = "cadence_blocks"
PARTS = "cadence_stage_parts"
SPLIT = "split_stages"


def model_blocks(model: nn.Module) -> list[nn.Module] | None:
    """The blocks ``model`` declares with ``cadence_blocks``, or None when it declares
    none. Raises `BlockProtocolError` for a declaration that names no modules."""
    spec = getattr(model, BLOCKS, None)
    if spec is None:
        return None
    name = type(model).__name__
    if isinstance(spec, str):
        try:
            found = operator.attrgetter(spec)(model)
        except AttributeError:
            raise BlockProtocolError(
                f"{name}.{BLOCKS} = {spec!r} names no attribute of the model"
            ) from None
    elif callable(spec):
        found = spec()
    else:
        raise BlockProtocolError(
            f"{name}.{BLOCKS} must be an attribute name (str) or a method, got {spec!r}"
        )
    if isinstance(found, nn.Module) and not isinstance(found, nn.ModuleList):
        found = [found]
    blocks = list(found) if isinstance(found, (nn.ModuleList, Sequence)) else None
    if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
        raise BlockProtocolError(
            f"{name}.{BLOCKS} must give a non-empty list of nn.Modules, got {found!r:.80}"
        )
    return blocks


def can_split(model: nn.Module) -> bool:
    """Whether ``model`` declares a way to be cut into pipeline stages."""
    return callable(getattr(model, SPLIT, None)) or getattr(model, PARTS, None) is not None


def split_model(model: nn.Module, num_stages: int) -> list[nn.Module]:
    """``model`` cut into ``num_stages`` stages: its own ``split_stages``, else
    `split_by_parts`. Raises `BlockProtocolError` when it declares neither."""
    split = getattr(model, SPLIT, None)
    if callable(split):
        stages = list(split(num_stages))
        if len(stages) != num_stages or not all(isinstance(s, nn.Module) for s in stages):
            raise BlockProtocolError(
                f"{type(model).__name__}.{SPLIT}({num_stages}) must return {num_stages} "
                f"nn.Modules, got {len(stages)} items"
            )
        return stages
    if getattr(model, PARTS, None) is not None:
        return split_by_parts(model, num_stages)
    raise BlockProtocolError(
        f"{type(model).__name__} cannot be cut into pipeline stages: give it a "
        f"{SPLIT}(n) method or a {PARTS} tuple (cadence.models.protocol)"
    )


def split_by_parts(model: nn.Module, num_stages: int) -> list[nn.Module]:
    """Cut a model shaped ``before -> blocks -> after`` (its ``cadence_stage_parts``,
    with the blocks named by ``cadence_blocks``): blocks spread as evenly as possible,
    the parts before them on the first stage and the parts after on the last. The
    stages share the model's parameters."""
    name = type(model).__name__
    parts: Sequence[str] | None = getattr(model, PARTS, None)
    blocks_name = getattr(model, BLOCKS, None)
    if (
        parts is None
        or isinstance(parts, str)
        or not isinstance(blocks_name, str)
        or blocks_name not in parts
    ):
        raise BlockProtocolError(
            f"{name}.{PARTS} must be a tuple of attribute names that includes its "
            f"{BLOCKS} (the name of its ModuleList of blocks), got {parts!r}"
        )
    blocks = model_blocks(model)
    assert blocks is not None  # blocks_name is a str
    cut = list(parts).index(blocks_name)
    before = [operator.attrgetter(p)(model) for p in parts[:cut]]
    after = [operator.attrgetter(p)(model) for p in parts[cut + 1 :]]
    n = len(blocks)
    if not 1 <= num_stages <= n:
        raise BlockProtocolError(
            f"{name} has {n} blocks: it cannot be cut into {num_stages} pipeline stages "
            f"(at most one stage per block)"
        )
    if num_stages > 1:
        first = {id(p) for m in before for p in m.parameters()}
        shared = [pn for m in after for pn, p in m.named_parameters() if id(p) in first]
        if shared:
            raise BlockProtocolError(
                f"{name} ties parameters of its first and last parts ({shared[0]}: tied "
                "embeddings), which cannot be split across pipeline stages; build it untied"
            )
    bounds = [round(i * n / num_stages) for i in range(num_stages + 1)]
    stages: list[nn.Module] = []
    for s in range(num_stages):
        mods: list[nn.Module] = list(before) if s == 0 else []
        mods.extend(blocks[bounds[s] : bounds[s + 1]])
        if s == num_stages - 1:
            mods.extend(after)
        stages.append(nn.Sequential(*mods))
    return stages
