"""Keep training without a lost replica: `cadence.DataParallel` under torchft's ``Manager``.

Needs the ``ft`` extra (``pip install 'cadence[ft]'``, torchft 0.2.0). Reached as
``cadence.ft``; it is not part of ``cadence.__all__``. How to use it, what it keeps
and what it does not: "Keep training without a lost node (torchft)" in
``docs/multinode.md``.

[Note: DataParallel under a torchft quorum]
torchft keeps the surviving data-parallel replicas training when one dies: a
lighthouse forms a quorum of the live replica groups at each step, the gradients are
averaged over the replicas that take part, and the optimizer steps only when every
one of them votes that the step went well. A replica that returns copies the weights
and optimizer state from a peer before it takes part again. torchft's own DDP meets
it at four seams; cadence meets it at the same four without a quorum of its own:

1. The quorum starts at the step's start (``manager.start_quorum()``, called by
   torchft's ``OptimizerWrapper.zero_grad()``), so it is computed during the forward.
2. Each bucket goes through ``manager.allreduce`` (a comm hook, `allreduce_hook`):
   the manager sums it over the quorum's process group and divides by the number of
   replicas that take part; a replica that is healing contributes zeros. A failed
   peer does not raise here: the manager records the error, and the step is voted
   down at the gate.
3. The optimizer steps only when ``manager.should_commit()`` says every replica's step
   went well (torchft's ``OptimizerWrapper.step()``).
4. The bucket layout is fixed: cadence builds its buckets once, at construction, from
   the registration order and the caps, and never rebuilds them (torchft's DDP has to
   force torch DDP's reducer not to rebuild), so a returning replica reduces the same
   buffers in the same order. The model's and optimizer's state dicts are registered
   with the manager (`register_state`), which sends them to a returning replica.

The DataParallel's own group is the replica group's; with one rank per replica group
(the only layout this module accepts for now) it is a world of 1, so DataParallel
itself issues no collective and every byte between replicas goes through torchft.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import torch
from torch import nn

from cadence.data_parallel import DataParallel
from cadence.data_parallel.comm_hooks import GradBucket
from cadence.errors import CadenceRuntimeError, CadenceValueError

__all__ = [
    "Manager",
    "ReplicaReduction",
    "allreduce_hook",
    "data_parallel",
    "optimizer",
    "register_state",
    "torchft",
]

TORCHFT_PIN = "0.2.0"  # the version the `ft` extra pins and docs/multinode.md measured
_MISSING = "cadence.ft needs torchft: pip install 'cadence[ft]' (torchft==" + TORCHFT_PIN + ")"


class Manager(Protocol):
    """The part of ``torchft.Manager`` cadence calls (typed without importing torchft)."""

    def allreduce(self, tensor: torch.Tensor) -> Any: ...

    def start_quorum(self) -> None: ...

    def should_commit(self) -> bool: ...

    def current_step(self) -> int: ...

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None: ...


def torchft() -> ModuleType:
    """The ``torchft`` package, or `CadenceRuntimeError` naming the extra to install."""
    try:
        # By name: the optional extra is imported only when asked for, and mypy, which
        # runs where torchft is not installed (it ships no type information), has no
        # import to resolve.
        return importlib.import_module("torchft")
    except ImportError:
        raise CadenceRuntimeError(_MISSING) from None


class ReplicaReduction:
    """One bucket's average over the live replicas, as DataParallel waits for it.

    Wraps the work ``manager.allreduce`` returns. ``wait()`` leaves the average in
    the bucket; if a peer failed, the manager has recorded it, the bucket holds
    garbage, and ``should_commit()`` votes the step down, so the garbage is never
    stepped (the next backward overwrites the bucket).
    """

    __slots__ = ("_done", "_work")

    def __init__(self, work: Any) -> None:
        self._work = work
        self._done = False

    def is_completed(self) -> bool:
        # Only after wait(): torchft divides by the number of replicas in the callback
        # that wait() runs, so the gloo work's completion is not the average's.
        return self._done

    def wait(self) -> None:
        if not self._done:
            self._work.wait()
            self._done = True


def allreduce_hook(state: Manager, bucket: GradBucket) -> ReplicaReduction:
    """DataParallel comm hook: average the (un-divided) bucket over torchft's quorum.

    The reduction is waited when DataParallel finalizes (the end of backward, or the
    caller's ``finalize_backward()``), not in the hook, so it overlaps the rest of
    backward as DataParallel's own all-reduce does. (torchft's DDP waits inside its
    hook: torch DDP's reducer could hang on torchft's future otherwise.)
    """
    return ReplicaReduction(state.allreduce(bucket.buffer()))


def data_parallel(module: nn.Module, manager: Manager, **kwargs: Any) -> DataParallel:
    """`cadence.DataParallel` whose buckets are averaged over torchft's live replicas.

    Args:
        module: the model replica. Initialise it the same way on every replica, or
            let the manager's ``init_sync`` copy a peer's weights at step 0.
        manager: the replica group's ``torchft.Manager``.
        kwargs: `DataParallel`'s own arguments. ``group=`` (default: the world) is
            the replica group's own group and must hold one rank. Refused:
            ``find_unused_parameters`` and ``static_graph`` (their used map is
            all-reduced over DataParallel's own group, so it would cover this replica
            only), and sparse gradients (torchft averages dense tensors only).

    Returns:
        The wrapper, with `allreduce_hook` registered. Pair it with `optimizer` (the
        commit gate) and `register_state` (what a returning replica receives).
    """
    torchft()  # fail here, in one line, rather than at the first backward
    for flag in ("find_unused_parameters", "static_graph"):
        if kwargs.get(flag):
            raise CadenceValueError(
                f"cadence.ft.data_parallel: {flag}=True is not supported: its used-parameter "
                "map is all-reduced over DataParallel's own group, which holds this replica "
                "only. Fix: make every parameter get a gradient each step."
            )
    dp = DataParallel(module, **kwargs)
    if dp.process_group.size() != 1:
        raise CadenceValueError(
            f"cadence.ft.data_parallel: the replica group's own group has "
            f"{dp.process_group.size()} ranks; this prototype takes one rank per replica "
            "group (torchft connects rank i of every replica group, so a group of several "
            "ranks would also need the average within the group). Fix: one rank per replica."
        )
    if any(b.sparse for b in dp._reducer.buckets):
        raise CadenceValueError(
            "cadence.ft.data_parallel: the model has sparse gradients (an embedding with "
            "sparse=True), which torchft's all-reduce cannot average. Fix: sparse=False."
        )
    dp.register_comm_hook(manager, allreduce_hook)
    # Stepping each bucket as its reduction lands would step before the commit vote,
    # and a voted-down step could not be taken back: refused on this instance, loudly,
    # rather than documented and left to be found in a diverged replica.
    dp.overlap_optimizer = _no_overlap_optimizer  # type: ignore[method-assign]
    return dp


def _no_overlap_optimizer(*args: Any, **kwargs: Any) -> Any:
    raise CadenceValueError(
        "overlap_optimizer is not supported under cadence.ft: it steps each bucket as its "
        "reduction lands, before torchft's commit vote, and a voted-down step cannot be "
        "undone. Fix: step the optimizer from cadence.ft.optimizer(manager, opt) after "
        "backward."
    )


def optimizer(manager: Manager, optim: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """torchft's ``OptimizerWrapper``: ``zero_grad()`` starts the step's quorum, ``step()``
    steps only when ``manager.should_commit()`` says every live replica's step went well.

    Call ``zero_grad()`` before the forward (the quorum is computed during it) and
    ``step()`` after backward, as with torchft's own DDP.
    """
    wrapper: torch.optim.Optimizer = torchft().optim.OptimizerWrapper(manager, optim)
    return wrapper


def register_state(
    manager: Manager, dp: DataParallel, optim: torch.optim.Optimizer, *, key: str = "cadence"
) -> None:
    """Register what a returning replica copies from a peer: the model and optimizer state.

    The manager reads ``state_dict`` on its quorum thread while the forward runs (the
    weights change only at the optimizer step, after the quorum), and applies
    ``load_state_dict`` on the training thread before the commit vote, so a healed
    replica steps from exactly its peer's weights and optimizer state.
    """
    inner = getattr(optim, "optim", optim)  # the optimizer under torchft's wrapper

    def state_dict() -> dict[str, Any]:
        return {"model": dp.module.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        dp.module.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager.register_state_dict_fn(key, load_state_dict, state_dict)
