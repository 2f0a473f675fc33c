"""Which fully_shard unit manages a parameter: ties across units are refused.

[Note: parameter identity across units]
Each unit shards, all-gathers and reduces its own copy of its parameters, so one
parameter sharded by two units trains as two parameters: the tie silently breaks. A
later `fully_shard` call must therefore recognise a parameter that an earlier call
already sharded, whether the earlier unit is nested in the module being sharded (an
embedding unit tied to a head owned by the root) or beside it (``fully_shard(m.emb)``,
then ``fully_shard(m.out)`` where ``m.out.weight is m.emb.weight``: FSDP2 raises "already
managed by another FSDP group").

Recognising it by ``id()`` alone is wrong: once the user's original parameter is freed
(its unit replaced it by the sharded one), a parameter created later may get the same
id, and sharding block by block with ``gc.collect()`` in between then reports a false
tie (torch's ``test_layer_by_layer_shard_no_false_positive``). So, as FSDP2 does, each
original parameter a unit takes is stamped with a fresh number (an attribute, which
lives and dies with that very object, so a new object never carries it), and the
number maps to the unit, held weakly: a model that was dropped leaves nothing behind.
No weak reference is taken to a parameter: a tensor with one cannot be swapped by
``torch.utils.swap_tensors``, which ``nn.Module._apply`` uses for DTensor parameters.
The unit's own sharded and unsharded parameters (what a module holds when a tie is made
after sharding, ``m.out.weight = m.emb.weight``) are recognised by identity among the
live units' parameters: they are alive while their unit is, so their ids cannot be reused.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from cadence.fsdp._errors import FullyShardError, FullyShardValueError


class Unit(Protocol):
    """What this module reads of a `cadence.fsdp._unit.Unit` (not imported: _unit imports
    _param, which imports this module)."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def params(self) -> Sequence[Any]: ...  # ParamInfo: .sharded, .unsharded


__all__ = ["Owners", "claim", "tie_error"]

_UID = "_cadence_fully_shard_uid"  # the stamp's attribute name
_uids = itertools.count()
_owners: dict[int, weakref.ref[Unit]] = {}  # stamp -> the unit that shards that parameter
_units: weakref.WeakSet[Unit] = weakref.WeakSet()  # every live unit


def claim(unit: Unit, originals: Iterable[torch.Tensor]) -> None:
    """Record ``unit`` as the manager of the user's ``originals`` (and of its own params)."""
    for dead in [uid for uid, ref in _owners.items() if ref() is None]:
        del _owners[dead]
    unit_ref = weakref.ref(unit)
    for p in originals:
        uid = next(_uids)
        setattr(p, _UID, uid)
        _owners[uid] = unit_ref
    _units.add(unit)


class Owners:
    """Who manages which parameter, as of now (build one per fully_shard call)."""

    def __init__(self) -> None:
        # ids of live objects only (each unit holds its parameters), so never reused
        self._live = {
            id(t): unit
            for unit in list(_units)
            for info in unit.params
            for t in (info.sharded, info.unsharded)
            if t is not None
        }

    def of(self, param: torch.Tensor) -> Unit | None:
        """The live unit that sharded this very object, or None (never by a reused id)."""
        uid = param.__dict__.get(_UID)
        if uid is not None:
            ref = _owners.get(uid)
            unit = ref() if ref is not None else None
            if unit is not None:
                return unit
        return self._live.get(id(param))


def tie_error(fqn: str, owner: Unit, root: nn.Module) -> FullyShardError:
    """Why ``root``'s parameter ``fqn``, already sharded by ``owner``, cannot be sharded."""
    where = type(owner.module).__name__
    if any(m is root for m in owner.module.modules()):
        # Not a tie: the unit above already sharded it (top-down order).
        return FullyShardError(
            f"parameter {fqn!r} was already sharded by the fully_shard call on its ancestor "
            f"{where} (fully_shard applied top-down?); apply fully_shard once per module, "
            "bottom-up: the inner modules first, then their parents, then the root."
        )
    if any(m is owner.module for m in root.modules()):
        place = f"the nested fully_shard unit {where}"
    else:
        place = (
            f"the fully_shard unit {where}, which an earlier fully_shard call sharded "
            "outside this module (a sibling)"
        )
    # FSDP2 raises ValueError for a parameter shared between two of its groups.
    return FullyShardValueError(
        f"parameter {fqn!r} is tied to a parameter of {place}: tying across units is not "
        "supported because each unit shards and reduces its own parameters, so the tie "
        "would silently break. Fix: apply fully_shard to a module that contains every use "
        "of the tied parameter (e.g. their common parent or the root), and not to the "
        "modules that each hold one use (cadence has no fully_shard([a, b]) form)."
    )
