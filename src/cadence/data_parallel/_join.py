"""Uneven inputs: DataParallel's side of torch's ``Join`` protocol.

[Note: DP join]
With uneven inputs a rank that runs out of batches leaves its training loop and
enters torch's ``Join.__exit__``, while the other ranks keep issuing the
collectives of their steps. Every collective an active rank issues in a step
must be matched, in the same order and with the same shapes and dtypes, by each
rank that has joined, or the active ranks wait forever. One step of an active
rank, from its forward on, is:

1. ``Join.notify_join_context``: an all-reduce of 1 (the joined ranks' count
   all-reduce of 0 in ``Join.__exit__`` matches it), plus, with
   ``throw_on_early_termination``, the all-reduce that tells every rank to raise.
   Both are torch's, issued by torch's own code, so they are not in the event log.
2. With buffer broadcasting: an all-reduce (MAX) that picks the newest active
   rank as the source, then the buffer broadcast(s) from it. Rank 0 may have
   joined already, and its buffers would be stale.
3. An all-reduce of "this step's backward syncs" (1) that joined ranks read, so
   they know whether to shadow a backward (0 for a forward without grad).
4. The backward: one all-reduce per bucket, in bucket order (through the comm
   hook if one is registered), then the used-map all-reduce with
   ``find_unused_parameters``.

A joined rank shadows 2-4 in ``main_hook`` with zeros, so it contributes nothing
to the sums. The active ranks divide by the initial world size (torch DDP's
default, every sample weighs the same) or, with
``divide_by_initial_world_size=False``, by the number of active ranks, read from
the result of 1. When every rank has joined, ``post_hook`` broadcasts the
parameters (and buffers, when they are broadcast at forward) from the highest
rank among the last to join, as torch DDP does, so every rank ends with the same
model. 2-4 go through the wrapper's `Comm` objects: the gradient all-reduces
under its log name ``dp``, the join bookkeeping under ``dp.join``.

What cannot be shadowed is refused before any collective: by ``model.join()``,
at each forward (and each ``main_hook``) inside an enabled join, and by the
setters themselves inside one. A joined rank learns only "this step syncs" at
forward, so a sync decision taken later (``no_sync()``,
``require_backward_grad_sync = False``, a deferred reduction by
``finalize_backward``), a window the caller finalizes (manual finalization, split
backwards) or a first step that learns the graph (``static_graph``) would leave
joined ranks in a different collective.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from cadence.comm import Comm, CommWork
from cadence.data_parallel._buckets import Bucket, empty_sparse_like, views_into
from cadence.data_parallel._errors import DataParallelError
from cadence.data_parallel._reducer import FutureWork, Reducer
from cadence.data_parallel.comm_hooks import GradBucket, is_future
from cadence.errors import CadenceValueError

__all__ = [
    "DataParallelJoinHook",
    "JoinableDataParallel",
    "join_forward",
    "refuse_inside_join",
]


class _JoinableDataParallel(Protocol):
    """What the join code reads from `DataParallel` (kept apart to avoid an import cycle)."""

    module: nn.Module
    broadcast_buffers: bool
    _join_config: _JoinConfig
    _join_comm: Comm
    _reducer: Reducer
    _ignored: frozenset[str]
    _no_sync_depth: int
    _join_divide_by_initial_world_size: bool
    _join_works: list[CommWork]

    @property
    def _buffers_to_sync(self) -> list[torch.Tensor]: ...

    def _syncs_buffers_at_forward(self) -> bool: ...

    def _broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0) -> None: ...


def refuse_inside_join(dp: _JoinableDataParallel, what: str, fix: str) -> None:
    """Raise (locally, before any collective) if ``what`` is called inside an enabled join."""
    if dp._join_config.enable:
        raise DataParallelError(
            f"{what} inside DataParallel.join() / Join([...]) is not supported: ranks that "
            f"have joined could not shadow the collectives it changes. Fix: {fix}"
        )


def check_can_join(dp: _JoinableDataParallel) -> None:
    """The settings a join needs: checked by join(), at each forward and at each main_hook."""
    r = dp._reducer
    problems = []
    if r.manual:
        problems.append(
            "require_manual_backward_finalization=True (set it to False for the join "
            "context: automatic finalization is what joined ranks shadow)"
        )
    if r.static_graph:
        problems.append(
            "static_graph=True (its first step learns the graph without overlap; construct "
            "DataParallel without static_graph to train on uneven inputs)"
        )
    if not r.require_sync or dp._no_sync_depth > 0:
        problems.append(
            "gradient sync is off (require_backward_grad_sync=False or inside no_sync()); "
            "turn it on before entering the join context and accumulate outside it"
        )
    if r.pending or r.accumulating:
        problems.append(
            "gradients of an earlier backward are still unreduced or unfinalized; call "
            "finalize_backward() before entering the join context"
        )
    if r.split_part is not None:
        problems.append("a split_backward() part is open; close it first")
    if r.comm_hook is not None and not dp._join_divide_by_initial_world_size:
        problems.append(
            "divide_by_initial_world_size=False with a comm hook (the hook does the "
            "averaging, so the active-rank count cannot reach it; torch DDP ignores the "
            "flag there). Pass True, or divide inside your hook"
        )
    if problems:
        raise DataParallelError(
            "DataParallel cannot join (uneven inputs) with: " + "; ".join(problems) + "."
        )


class _ActiveRanks:
    """The number of active ranks this step: the result of Join's notify all-reduce.

    Waited only when the first bucket is scaled (as torch DDP), not at forward.
    """

    def __init__(self, work: Any) -> None:
        self._work = work
        self._value: int | None = None

    def __call__(self) -> int:
        if self._value is None:
            self._work.wait()
            self._value = int(self._work.get_future().value()[0].item())
        return self._value


def _common_rank(dp: _JoinableDataParallel, candidate: bool) -> int:
    """The highest rank among the candidates (an all-reduce MAX every rank joins)."""
    comm = dp._join_comm
    rank = torch.tensor([comm.rank if candidate else -1], device=_device(dp))
    comm.all_reduce(rank, op="max")
    src = int(rank.item())
    if src < 0:
        raise DataParallelError("join: no rank was a candidate source (a bug in cadence)")
    return src


def _device(dp: _JoinableDataParallel) -> torch.device:
    return dp._reducer.buckets[0].buffer.device


def _drain(dp: _JoinableDataParallel) -> None:
    """Wait the bookkeeping all-reduces of the previous step (long finished in practice)."""
    for work in dp._join_works:
        work.wait()
    dp._join_works.clear()


def join_forward(dp: _JoinableDataParallel) -> None:
    """An active rank's collectives 1-3 of [Note: DP join], in DataParallel.forward."""
    r = dp._reducer
    check_can_join(dp)
    if not dp._join_divide_by_initial_world_size and not dp._join_config.is_first_joinable:
        raise DataParallelError(
            "divide_by_initial_world_size=False needs DataParallel to be the first joinable "
            "passed to Join([...]) (only the first one counts the active ranks). Fix: "
            "Join([model, optimizer, ...])."
        )
    _drain(dp)
    work = Join.notify_join_context(dp)  # type: ignore[arg-type]  # raises on early termination
    if work is not None and not dp._join_divide_by_initial_world_size:
        r.divisor = _ActiveRanks(work)
    if dp._syncs_buffers_at_forward():
        src = _common_rank(dp, True)
        with torch.no_grad():
            dp._broadcast_tensors(dp._buffers_to_sync, src=src)
    flag = torch.ones(1, device=_device(dp)) * float(torch.is_grad_enabled())
    dp._join_works.append(dp._join_comm.all_reduce(flag, async_op=True))


def leave_join(dp: _JoinableDataParallel) -> None:
    """Back to plain DataParallel: torch's Join never resets the config it set."""
    dp._join_works.clear()
    dp._reducer.divisor = None
    dp._join_config = _JoinConfig.construct_disabled_join_config()


class _DataParallelJoin(Join):
    """torch's `Join`, leaving the join mode also when the body raised.

    torch's ``__exit__`` returns early on an exception (a refusal, or
    ``throw_on_early_termination``) and leaves ``_join_config`` enabled, so every
    later forward would keep notifying a join that is over.
    """

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            for joinable in self._joinables:
                if isinstance(joinable, JoinableDataParallel):
                    leave_join(joinable)  # type: ignore[arg-type]  # the mixin; DataParallel has the protocol's members


def _zero_replica(bucket: Bucket) -> Bucket:
    """The bucket with a fresh zero buffer: what a joined rank contributes (nothing)."""
    if bucket.sparse:
        return dataclasses.replace(
            bucket, buffer=empty_sparse_like(bucket.params[0], bucket.buffer.dtype)
        )
    buffer = torch.zeros_like(bucket.buffer)
    return dataclasses.replace(bucket, buffer=buffer, views=views_into(buffer, bucket.params))


class DataParallelJoinHook(JoinHook):
    """Shadows an active rank's step on a joined rank; syncs the final model at the end."""

    def __init__(self, dp: _JoinableDataParallel, *, divide_by_initial_world_size: bool) -> None:
        # Settings are checked at each forward and main_hook, not here: torch's Join
        # makes the hooks before it says whether it is enabled, and a disabled join
        # must change nothing.
        self.dp = dp
        dp._join_divide_by_initial_world_size = bool(divide_by_initial_world_size)

    def main_hook(self) -> None:
        """Collectives 2-4 of [Note: DP join], with zeros."""
        dp = self.dp
        check_can_join(dp)
        _drain(dp)
        if dp._syncs_buffers_at_forward():
            src = _common_rank(dp, False)
            with torch.no_grad():
                dp._broadcast_tensors(dp._buffers_to_sync, src=src)
        flag = torch.zeros(1, device=_device(dp))
        dp._join_comm.all_reduce(flag)
        if flag.item() == 0:
            return  # the active ranks' forward ran without grad: no backward to shadow
        r = dp._reducer
        works: list[Any] = []
        last = len(r.buckets) - 1
        for bucket in r.buckets:
            replica = _zero_replica(bucket)
            if r.comm_hook is not None:
                state, hook = r.comm_hook
                result = hook(state, GradBucket(replica, r.comm, is_last=bucket.index == last))
                works.append(FutureWork(result, replica) if is_future(result) else result)
            else:
                works.append(r.comm.all_reduce(replica.buffer, async_op=True))
        if r.find_unused:
            # [Note: a joined rank's used map]
            # torch DDP's joined rank all-reduces the used map of its own last synced
            # step (already all-reduced then), not zeros: a parameter used anywhere in
            # that step counts as used in every shadowed step, so the active ranks
            # write its reduced (zero) gradient instead of leaving ``.grad`` as it
            # was. Matched, so momentum and weight decay move it as under DDP.
            previous = r.last_used_map
            used = (
                previous.clone()
                if previous is not None
                else torch.zeros(len(r.params), dtype=torch.int32, device=_device(dp))
            )
            works.append(r.comm.all_reduce(used, async_op=True))
        for work in works:
            work.wait()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank: broadcast the model from the highest of the last ranks to join."""
        dp = self.dp
        _drain(dp)
        leave_join(dp)
        src = _common_rank(dp, is_last_joiner)
        tensors: list[torch.Tensor] = [
            p for n, p in dp.module.named_parameters() if n not in dp._ignored
        ]
        if dp.broadcast_buffers:
            tensors += dp._buffers_to_sync
        with torch.no_grad():
            dp._broadcast_tensors(tensors, src=src)


class JoinableDataParallel(Joinable):
    """DataParallel's `Joinable` half: ``join()``, ``join_hook()`` and what torch's Join reads."""

    device: torch.device
    process_group: dist.ProcessGroup
    event_log: Any
    _comm: Comm

    def _init_join(self, *, ignored: frozenset[str]) -> None:
        """Called by DataParallel.__init__ (which stands in for Joinable's abstract one)."""
        Joinable.__init__(self)  # sets _join_config (disabled)
        self._join_comm = Comm(
            self.process_group,
            event_log=self.event_log,
            name="dp.join",
            algorithms=self._comm.algorithms,
        )
        self._join_divide_by_initial_world_size = True
        self._join_works: list[CommWork] = []
        self._ignored = ignored

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """torch DDP's context manager for uneven inputs: ``with model.join(): <loop>``.

        Ranks that run out of batches shadow the collectives of the others' steps
        with zeros, so nobody hangs; at the end the model is broadcast from the last
        rank to join. ``divide_by_initial_world_size``: average over the initial
        world size (True, each sample weighs the same) or over the ranks still
        active. ``throw_on_early_termination``: every rank raises ``RuntimeError``
        when the first one runs out. ``enable=False``: a no-op context. See
        [Note: DP join] in ``_join.py`` for the protocol and what is refused.
        """
        join = _DataParallelJoin(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )
        if enable:
            try:  # at entry, not at the first forward
                check_can_join(self)  # type: ignore[arg-type]  # the mixin; DataParallel has the protocol's members
            except DataParallelError:
                leave_join(self)  # type: ignore[arg-type]  # Join enabled it already
                raise
        return join

    def join_hook(self, **kwargs: Any) -> DataParallelJoinHook:
        """The `JoinHook` torch's ``Join([model, ...])`` asks for (kwargs as torch DDP's)."""
        unknown = set(kwargs) - {"divide_by_initial_world_size"}
        if unknown:
            raise CadenceValueError(
                f"DataParallel.join_hook() got unknown options {sorted(unknown)}; it takes "
                "divide_by_initial_world_size only"
            )
        return DataParallelJoinHook(
            self,  # type: ignore[arg-type]  # the mixin; DataParallel has the protocol's members
            divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True),
        )

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group
