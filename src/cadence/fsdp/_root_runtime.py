"""The runtime shared by every unit under one root: hooks, pending reductions, finalization.

Its Notes, each above the code it governs:

- `RootRuntime`: [Note: collective order];
- ``post_backward``: [Note: flags are read late];
- ``make_room``: [Note: bounded in-flight reductions];
- ``issue_reduction``: [Note: who keeps a reduce-scatter input alive],
  [Note: stale unsharded copies];
- ``retire``: [Note: HSDP partial reductions];
- ``wait_and_cleanup``: [Note: one wait-and-cleanup path].

The overlapped optimizer that steps units from that path lives in ``_overlap.py``.
"""

from __future__ import annotations

import enum
import functools
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_map

from cadence._grad_timing import autograd as _autograd
from cadence._grad_timing.pending_grad import GradGuard
from cadence.comm import Comm, CommWork, EventLog, ReductionHandle, phase
from cadence.fsdp._errors import FullyShardError
from cadence.fsdp._unit import PendingReduction, ShardedState, Unit


class OverlapHooks(Protocol):
    """What the runtime calls on ``overlap_optimizer``'s steppers (``_overlap.py``)."""

    @property
    def steps_early(self) -> bool: ...

    def on_unit_written(self, unit: Unit) -> None: ...

    def check_forward(self) -> None: ...

    def owns(self, optimizer: Any) -> bool: ...


__all__ = ["RootRuntime", "TrainingState"]


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


# [Note: collective order]
# Every rank issues collectives in program order: all-gathers in forward/pre-backward
# hook order (prefetch included), reduce-scatters in post-backward order, and the
# deferred reductions of ``finalize_backward`` in reverse registration order.
class RootRuntime:
    """State shared by the units of one root (FSDP2's FSDPState + FSDPCommContext)."""

    def __init__(self, root: Unit, units: list[Unit], event_log: EventLog | None) -> None:
        self.root = root
        self.units = units  # registration (bottom-up) order
        for unit in units:
            algorithms = unit.collective_algorithms
            unit.comm = Comm(
                unit.shard_group, event_log=event_log, name="dp_shard", algorithms=algorithms
            )
            if unit.replicate_group is not None:
                unit.replicate_comm = Comm(
                    unit.replicate_group,
                    event_log=event_log,
                    name="dp_replicate",
                    algorithms=algorithms,
                )
        # -- flags --
        self.manual_finalization = False
        # False (set_is_last_backward): the end of backward leaves reductions in flight.
        self.is_last_backward = True
        self.max_inflight_reductions = 1  # FSDP2's default; see set_max_inflight_reductions
        # -- iteration state --
        self.state = TrainingState.IDLE
        self.forward_order: list[Unit] = []
        self.last_forward_order: list[Unit] = []
        # Units whose latest forward ran on its own, outside the root's forward and any
        # backward: [Note: a unit run outside the root's forward].
        self.standalone: set[Unit] = set()
        self.backward_active = False
        self.split_part: str | None = (
            None  # see [Note: split backward parts] in _grad_timing/timing.py
        )
        # A fully_shard module's _apply is running: units it reaches re-seat only after it.
        self.applying = False
        # -- reductions: see [Note: one wait-and-cleanup path] --
        self.inflight: deque[PendingReduction] = deque()  # RS issued, not waited
        self.retired: list[PendingReduction] = []  # RS waited (AR maybe issued), grads not written
        self.handle: ReductionHandle | None = None
        # See [Note: gradients appear at finalization] in cadence/_grad_timing/pending_grad.py.
        self.grad_guard = GradGuard("fully_shard")
        self.cleanup_fault: Callable[[Unit], None] | None = None  # test hook
        # overlap_optimizer's steppers; with one that steps early, each unit is stepped
        # as soon as it is written (see [Note: one wait-and-cleanup path]).
        self.overlap: OverlapHooks | None = None
        self.event_log = event_log
        # -- accounting --
        self.peak_unsharded_bytes = 0
        self.peak_inflight_reduce_bytes = 0
        self.peak_inflight_reductions = 0

    # -- checks ---------------------------------------------------------------

    def check_no_pending_handle(self, what: str) -> None:
        if self.handle is not None and not self.handle.done:
            raise FullyShardError(
                f"{what} while a finalize_backward() handle is still pending: its reductions "
                "own the gradient buffers. Fix: call handle.wait() first."
            )

    def check_backward_finished(self, what: str) -> None:
        if self.backward_active:
            raise FullyShardError(
                f"{what}: the previous backward did not finish (it probably raised), so its "
                "reductions were never completed. Fix: call model.reset_iter_state() first."
            )

    # -- accounting -------------------------------------------------------------

    def note_unsharded(self) -> None:
        live = sum(u.unsharded_bytes for u in self.units)
        self.peak_unsharded_bytes = max(self.peak_unsharded_bytes, live)

    def _hidden_reduce_bytes(self) -> int:
        """Peak bytes the backend holds beside the in-flight reduce-scatter inputs.

        gloo's own reduce-scatter clones its whole input (an all-reduce, then a chunk
        copy); cadence's exchange receives one peer's chunk into the output and the
        other (world - 2) into a buffer (see [Note: why cadence replaces some of
        gloo's collectives]); NCCL holds none.
        """
        comm = self.units[0].comm if self.units else None
        peak = self.peak_inflight_reduce_bytes
        if comm is None or comm.backend != "gloo" or comm.world_size < 2:
            return 0
        if comm.algorithms.reduce_scatter in ("auto", "exchange"):
            return peak * (comm.world_size - 2) // comm.world_size
        return peak

    def memory_stats(self) -> dict[str, int]:
        inflight = sum(pr.input_bytes for pr in self.inflight)
        return {
            "sharded_param_bytes": sum(u.sharded_bytes for u in self.units),
            "unsharded_param_bytes": sum(u.unsharded_bytes for u in self.units),
            "peak_unsharded_param_bytes": self.peak_unsharded_bytes,
            "accumulated_grad_bytes": sum(u.accumulated_bytes for u in self.units),
            "inflight_reduce_bytes": inflight,
            "peak_inflight_reduce_bytes": self.peak_inflight_reduce_bytes,
            "gloo_hidden_reduce_bytes": self._hidden_reduce_bytes(),
            "inflight_reductions": len(self.inflight),
            "peak_inflight_reductions": self.peak_inflight_reductions,
            "max_inflight_reductions": self.max_inflight_reductions,
        }

    # -- forward hooks ----------------------------------------------------------

    def pre_forward(self, unit: Unit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if unit is self.root:
            self.check_no_pending_handle("forward")
            self.check_backward_finished("forward")
            if self.overlap is not None and torch.is_grad_enabled():
                self.overlap.check_forward()
            self.forward_order = []
            self.standalone.clear()
            self.state = TrainingState.FORWARD
        elif self.state is TrainingState.IDLE and not self.backward_active:
            self.standalone.add(unit)
        else:
            self.standalone.discard(unit)
        if unit not in self.forward_order:
            self.forward_order.append(unit)
        unit.sync_requires_grad()  # see [Note: requires_grad after sharding] in _unit.py
        unit.unshard(async_op=False)
        self.note_unsharded()
        self.prefetch(self.forward_targets(unit))
        return unit.mp_policy.cast_inputs(args, kwargs)

    def post_forward(self, unit: Unit, output: Any) -> Any:
        grad_enabled = torch.is_grad_enabled()
        # [Note: forward inside backward]
        # A forward that runs while a backward is active is activation checkpointing's
        # recompute: the backward about to run needs these parameters, so the unit stays
        # unsharded until its post-backward (as FSDP2). Resharding here would free storage
        # the recomputed graph saved; a unit whose pre-backward already ran (used by two
        # forwards, DPO-style) would then never re-gather it.
        if unit.reshard_after_forward and not self.backward_active:
            unit.reshard()
        if grad_enabled:
            tensors, _ = tree_flatten(output)
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward_hook(unit))
        if unit is self.root:
            self.last_forward_order = list(self.forward_order)
            self.state = TrainingState.IDLE
            out_dtype = unit.mp_policy.output_dtype
            if out_dtype is not None:
                output = tree_map(
                    lambda x: (
                        x.to(out_dtype)
                        if isinstance(x, torch.Tensor) and x.is_floating_point()
                        else x
                    ),
                    output,
                )
        return output

    def forward_targets(self, unit: Unit) -> list[Unit]:
        if unit.forward_prefetch is not None:
            return unit.forward_prefetch
        order = self.last_forward_order
        if unit in order:
            i = order.index(unit)
            if i + 1 < len(order):
                return [order[i + 1]]
        return []

    # [Note: a unit run outside the root's forward]
    # A loss may call a unit on its own after the root's forward: a head run per chunk
    # of the hidden states (chunked cross-entropy), each chunk's backward its own. That
    # backward reaches only the unit, so the unit before it in the forward order is no
    # backward-prefetch target: gathering it would be undone by the end of that backward
    # and cost one all-gather per chunk. An explicit set_modules_to_backward_prefetch
    # still holds.

    def backward_targets(self, unit: Unit) -> list[Unit]:
        if unit.backward_prefetch is not None:
            return unit.backward_prefetch
        if unit in self.standalone:
            return []
        order = self.forward_order
        if unit in order:
            i = order.index(unit)
            if i > 0:
                return [order[i - 1]]
        return []

    def prefetch(self, targets: list[Unit]) -> None:
        for target in targets:
            if target.state is ShardedState.SHARDED or target.stale:
                target.unshard(async_op=True)

    # -- backward hooks ---------------------------------------------------------

    def _pre_backward_hook(self, unit: Unit) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.pre_backward(unit)

        return hook

    def pre_backward(self, unit: Unit) -> None:
        if unit.pre_backward_done:
            return
        if not self.backward_active:
            self.backward_active = True
            self.state = TrainingState.BACKWARD
            _autograd.queue_callback(self.final_callback)
        unit.pre_backward_done = True
        unit.unshard(async_op=False)
        self.note_unsharded()
        # A unit whose post-backward already ran (the root, typically) needs nothing.
        self.prefetch([t for t in self.backward_targets(unit) if not t.post_backward_done])

    def post_accumulate(self, unit: Unit) -> None:
        """Post-accumulate-grad hook of one of ``unit``'s parameters."""
        unit.hooks_fired += 1
        if unit.hooks_fired >= unit.num_grad_params:
            self.post_backward(unit)

    # [Note: flags are read late]
    # ``set_requires_gradient_sync`` / ``set_reshard_after_backward`` / the manual-finalization
    # flag only set attributes. The post-backward hook reads a unit's flags when it runs, and
    # ``finalize_backward`` reads them when it is called. Nothing ever overrides a flag
    # temporarily: a finalize that forced sync on and restored it afterwards would reduce
    # units the caller deliberately left accumulating, and its effect would depend on state
    # the caller cannot see. Following the flags makes ``finalize_backward`` predictable:
    # it reduces exactly what the current flags say is owed.
    def post_backward(self, unit: Unit) -> None:
        """Reshard per flag, then reduce now (sync) or accumulate locally (no sync)."""
        if unit.post_backward_done:
            return
        unit.post_backward_done = True
        grads = unit.take_unsharded_grads()
        if unit.reshard_after_backward:
            unit.reshard()
        if unit.requires_gradient_sync:
            if grads is not None or unit.accumulated is not None:
                # Retire the oldest in-flight reduction *before* building the next
                # input, not after: the two (W, S) inputs (and gloo's internal copy of
                # the old one) are then never alive together. The wait happens at
                # the same point of backward, so the overlap is the same.
                self.make_room()
            rs_input = unit.reduce_input(grads)
            del grads  # the unsharded grads are copied into rs_input: free them now
            if rs_input is not None:
                self.issue_reduction(unit, rs_input)
        elif grads is not None:
            unit.accumulate(grads)

    # [Note: bounded in-flight reductions]
    # Each in-flight reduce-scatter keeps its (W, S) input alive until it is waited (gloo
    # even clones it internally). Unbounded, one backward would hold an input per unit, the
    # whole unsharded gradient of the model. ``max_inflight_reductions`` (default 1, as
    # FSDP2) bounds them: issuing one more first waits the oldest, so each reduce-scatter
    # still overlaps the next unit's backward for the price of one extra buffer. The
    # oldest is retired before the next input is even built, so two inputs are never alive
    # together. 0 waits each at once (no overlap, least memory). The one buffer is the
    # whole memory price of the overlap: during the next unit's backward this runtime holds
    # what FSDP2 holds (FSDP2 on CPU waits each reduce-scatter at once) plus one in-flight
    # input and the backend's staging of it.
    def make_room(self) -> None:
        """Retire the oldest reductions until one more fits under the bound."""
        while self.inflight and len(self.inflight) >= self.max_inflight_reductions:
            self.retire(self.inflight.popleft())

    def issue_reduction(self, unit: Unit, rs_input: torch.Tensor) -> None:
        with phase("fsdp.reduce_scatter"):
            self._issue_reduction(unit, rs_input)

    def _issue_reduction(self, unit: Unit, rs_input: torch.Tensor) -> None:
        # [Note: who keeps a reduce-scatter input alive]
        # The work does, not the runtime: gloo's own reduce-scatter keeps it (the
        # CommWork's tensors) until waited, because gloo reads it on its own threads
        # until then; an exchange (cadence/_groups/exchange.py) keeps it only until its
        # messages are sent and its sum is done, on the group's finisher thread. So
        # with exchanges the (W, S) input is freed a few milliseconds after issue,
        # while the reduction still counts as in flight here: the overlap of an async
        # reduce-scatter without its input's memory for the rest of the next unit's
        # backward.
        # See [Note: bounded in-flight reductions]: retire the oldest before issuing more.
        self.make_room()
        assert unit.comm is not None
        with unit.streams.issue("reduce_scatter"):
            unit.streams.used_by(rs_input, "reduce_scatter")
            if unit.world == 1:
                # A shard group of one: the average over one rank is the input itself,
                # so no collective (as FSDP2; see [Note: a shard group of one] in _unit.py).
                rs_output, work = rs_input.view(-1), CommWork(None)
            else:
                rs_output = torch.empty(
                    unit.shard_numel, dtype=unit.reduce_dtype, device=unit.device
                )
                work = unit.comm.reduce_scatter_single(
                    rs_output, rs_input.view(-1), op="avg", async_op=True
                )
        nbytes = rs_input.numel() * rs_input.element_size()
        used = unit.take_grads_seen()  # see [Note: parameters without a gradient] in _unit.py
        self.inflight.append(PendingReduction(unit, nbytes, rs_output, work, used))
        if self.max_inflight_reductions == 0:
            self.retire(self.inflight.popleft())  # synchronous mode: FSDP2-on-CPU memory
        self.peak_inflight_reductions = max(self.peak_inflight_reductions, len(self.inflight))
        self.peak_inflight_reduce_bytes = max(
            self.peak_inflight_reduce_bytes, sum(pr.input_bytes for pr in self.inflight)
        )
        # [Note: stale unsharded copies]
        # ``reshard_after_backward=False`` is honoured after a syncing reduction: the unit stays
        # unsharded, as the flag says. Its unsharded parameters then predate the optimizer step
        # that will apply these gradients, so the unit is marked stale and its next forward
        # re-gathers the (updated) shards instead of computing with old values. Resharding
        # regardless would be cheaper to reason about but would override a flag the caller set
        # (see [Note: flags are read late]). In no-sync accumulation nothing is reduced, the
        # optimizer does not step, and nothing goes stale.
        if unit.state is not ShardedState.SHARDED:
            unit.stale = True

    # [Note: HSDP partial reductions]
    # ``set_requires_all_reduce(False)`` (HSDP only) keeps the reduce-scatter over the
    # shard group but skips the all-reduce over replicas: the shard-averaged output is
    # added into the unit's ``partial_reduce`` and nothing is written to ``.grad``. The
    # next reduction with the flag on adds the partial sum before its all-reduce (or
    # ``finalize_backward`` all-reduces it alone), so replicas exchange one all-reduce
    # per accumulation window instead of one per microbatch; the average is the same.
    def retire(self, pr: PendingReduction) -> None:
        pr.rs_work.wait()
        pr.input_nbytes = 0
        unit = pr.unit
        if unit.replicate_comm is not None:
            if not unit.requires_all_reduce:
                # See [Note: HSDP partial reductions].
                if unit.partial_reduce is None:
                    unit.partial_reduce = pr.rs_output
                else:
                    unit.partial_reduce += pr.rs_output
                pr.held = True
            else:
                if unit.partial_reduce is not None:
                    pr.rs_output += unit.partial_reduce
                    unit.partial_reduce = None
                    pr.used = None  # earlier backwards' parameters are in it too
                # HSDP: the all-reduce over replicas needs the finished shard, so it is
                # issued here, asynchronously, and waited in wait_and_cleanup.
                with unit.streams.issue("reduce_scatter"):
                    pr.ar_work = unit.replicate_comm.all_reduce(
                        pr.rs_output, op="avg", async_op=True
                    )
        self.retired.append(pr)

    def final_callback(self) -> None:
        """End of the outermost backward: finish units whose hooks never fired."""
        # The input part of a split backward finishes no unit: the weight part will.
        if self.split_part != "input":
            for unit in reversed(self.forward_order or self.units):
                if unit.pre_backward_done and not unit.post_backward_done:
                    self.post_backward(unit)
        for unit in self.units:
            if unit.state is ShardedState.UNSHARDING:
                unit.reshard()  # a prefetch nobody consumed
            elif (
                unit.state is ShardedState.UNSHARDED
                and unit.reshard_after_backward
                and self.split_part != "input"
            ):
                # Every post-backward has run, so a unit still unsharded was gathered by a
                # forward (reshard_after_forward=False) whose outputs this backward never
                # reached, or by a recompute after its post-backward: reshard it as a
                # post-backward would (FSDP2's final callback does too), so the module shows
                # its sharded parameters, with the .grad the optimizer steps, and the next
                # forward re-gathers the new values.
                unit.reshard()
            unit.pre_backward_done = False
            unit.post_backward_done = False
            unit.hooks_fired = 0
        self.backward_active = False
        self.state = TrainingState.IDLE
        if not self.manual_finalization and self.is_last_backward:
            self.wait_and_cleanup()
        else:
            self.guard_pending_grads()

    # -- split backward (see [Note: split backward parts] in cadence/_grad_timing/timing.py) --

    def begin_split_part(self, part: str) -> None:
        self.check_no_pending_handle(f"split_backward({part!r})")
        self.check_backward_finished(f"split_backward({part!r})")
        self.split_part = part
        if part != "weight":
            return
        # A forward since the input part may have resharded a unit (reshard after
        # forward): the weight part needs the parameters the graph saved.
        for unit in self.units:
            unit.unshard(async_op=False)
        self.note_unsharded()
        # One backward for the hooks, however many autograd calls it takes: no
        # end-of-backward callback is queued; end_split_part finishes it.
        self.backward_active = True
        self.state = TrainingState.BACKWARD

    def end_split_part(self) -> None:
        part, self.split_part = self.split_part, None
        if part == "weight":
            for unit in self.units:
                if unit.hooks_fired:
                    unit.pre_backward_done = True
            self.final_callback()

    # -- finalization -----------------------------------------------------------

    def guard_pending_grads(self) -> None:
        """Put `PendingGrad` in the ``.grad`` of units whose reduction is not written yet."""
        for pr in list(self.inflight) + self.retired:
            if not pr.held:
                self.grad_guard.poison(
                    (info.fqn, info.sharded)
                    for info in pr.unit.params
                    if info.requires_grad and info.sharded is not None
                )

    # [Note: one wait-and-cleanup path]
    # The automatic end-of-backward callback and the public ``finalize_backward`` both end
    # in ``RootRuntime.wait_and_cleanup``: wait reduce-scatters in issue order, issue and wait
    # the HSDP all-reduces, write the sharded ``.grad`` of each unit, and pop each unit only
    # after its write-back succeeded. A cleanup exception therefore leaves the remaining
    # units queued, and a retry completes each exactly once.
    #
    # With an optimizer that steps early (``overlap_optimizer``), the same path goes one
    # unit at a time, oldest first: wait its reduce-scatter (issuing its all-reduce), wait
    # its all-reduce, write it, pop it, then step its shards, and only then wait the next
    # unit's reduce-scatter. So a unit's update runs while later units' reductions are still
    # in flight. Without one, every reduce-scatter is waited first, so that every HSDP
    # all-reduce is issued before the first is waited (they overlap each other). The
    # collectives and their order are the same either way; only the waits move. A unit is
    # stepped after its write only when no later reduction of the same unit is still queued
    # (reductions left in flight by ``set_is_last_backward(False)`` add up in ``.grad``), and
    # never when its reduction was held (HSDP ``set_requires_all_reduce(False)``): then
    # ``opt.step()`` steps it. The step runs after the pop, so a retry never writes a unit
    # twice. A handle's ``wait()`` completes units the same way (``overlapped_works``).
    def wait_and_cleanup(self) -> None:
        """Wait every reduction and write the gradients back, oldest unit first."""
        if self.on_unit_written is None:
            while self.inflight:
                self.retire(self.inflight.popleft())
        while self.inflight or self.retired:
            self._complete_oldest()

    @property
    def on_unit_written(self) -> Callable[[Unit], None] | None:
        """Called with a unit right after its final write of this step, or None."""
        overlap = self.overlap
        return None if overlap is None or not overlap.steps_early else overlap.on_unit_written

    def _complete_oldest(self) -> None:
        """Retire the oldest reduction if needed, wait its all-reduce, write it back."""
        if not self.retired:
            self.retire(self.inflight.popleft())
        pr = self.retired[0]
        if pr.ar_work is not None:
            pr.ar_work.wait()
        if self.cleanup_fault is not None:
            self.cleanup_fault(pr.unit)
        if not pr.held:
            self.grad_guard.restore(
                info.sharded for info in pr.unit.params if info.sharded is not None
            )
            pr.unit.write_sharded_grads(pr.rs_output, pr.used)
        self.retired.pop(0)
        written = self.on_unit_written
        if written is not None and not pr.held and not self._queued(pr.unit):
            written(pr.unit)

    def _queued(self, unit: Unit) -> bool:
        return any(q.unit is unit for q in self.inflight) or any(
            q.unit is unit for q in self.retired
        )

    def _complete_through(self, pr: PendingReduction) -> None:
        while any(q is pr for q in self.inflight) or any(q is pr for q in self.retired):
            self._complete_oldest()

    def overlapped_works(self) -> list[CommWork]:
        """A finalize handle's works: waiting one completes (and steps) its unit at once.

        Without an early-stepping optimizer, the reduce-scatters themselves: the handle
        waits them all and then writes every unit (``wait_and_cleanup``).
        """
        if self.on_unit_written is None:
            return [pr.rs_work for pr in self.inflight]
        return [
            CommWork(pr.rs_work, after=functools.partial(self._complete_through, pr))
            for pr in self.inflight
        ]

    def check_all_launched_in_backward(self) -> None:
        """See [Note: finalize inside backward] in ``cadence/_grad_timing/timing.py``."""
        expected = [u for u in self.forward_order if u.num_grad_params > 0]
        launched = sum(u.post_backward_done for u in expected)
        if launched < len(expected):
            raise FullyShardError(
                f"finalize_backward() was called inside backward, but only {launched} of "
                f"{len(expected)} units have launched their reductions. Fix: finalize from a "
                "hook that runs after every unit's backward (e.g. on the input of the root "
                "module), or after loss.backward() returns."
            )

    def finalize_backward(self, *, async_op: bool) -> ReductionHandle | None:
        if self.handle is not None and not self.handle.done:
            raise FullyShardError(
                "finalize_backward() called again: wait on the previous finalize_backward() "
                "handle before finalizing backward again (handle.wait())."
            )
        if _autograd.in_backward():
            self.check_all_launched_in_backward()
        else:
            self.check_backward_finished("finalize_backward()")
        # Follow the current flags: units whose sync flag is on now reduce what they
        # accumulated; units still in no-sync mode keep accumulating.
        for unit in reversed(self.units):
            if unit.requires_gradient_sync and unit.accumulated is not None:
                rs_input = unit.reduce_input(None)
                assert rs_input is not None
                self.issue_reduction(unit, rs_input)
            elif (
                unit.requires_gradient_sync
                and unit.requires_all_reduce
                and unit.partial_reduce is not None
                and not any(pr.unit is unit for pr in self.inflight)
            ):
                # HSDP: all-reduce what earlier backwards reduce-scattered only.
                partial, unit.partial_reduce = unit.partial_reduce, None
                # No reduce-scatter input is held: 0 bytes in flight.
                self.inflight.append(PendingReduction(unit, 0, partial, CommWork(None)))
        if not self.inflight and not self.retired:
            self.handle = None
            return ReductionHandle.completed("fully_shard") if async_op else None
        pending = list(self.inflight) + list(self.retired)
        handle = ReductionHandle(
            self.overlapped_works(),
            on_complete=self.wait_and_cleanup,
            keepalive=(pending,),
            label="fully_shard",
        )
        self.handle = handle
        if not async_op:
            handle.wait()
            return None
        self.guard_pending_grads()  # until handle.wait() writes them
        return handle

    def reset_iter_state(self) -> None:
        """Discard in-flight reductions and no-sync accumulation after an aborted step."""
        for pr in list(self.inflight) + self.retired:
            pr.rs_work.wait()  # the backend may still write the buffers
            if pr.ar_work is not None:
                pr.ar_work.wait()
        self.inflight.clear()
        self.retired.clear()
        self.handle = None
        self.grad_guard.restore()
        for unit in self.units:
            unit.accumulated = None
            unit.partial_reduce = None
            unit.pre_backward_done = unit.post_backward_done = False
            unit.hooks_fired = 0
            unit.take_grads_seen()
            for info in unit.params:
                assert info.unsharded is not None
                info.unsharded.grad = None
            unit.reshard()
        self.backward_active = False
        self.split_part = None
        self.state = TrainingState.IDLE

    def reshard_all_idle(self, what: str) -> None:
        """Between steps only: reshard every unit and adopt replaced parameters.

        See [Note: parameters replaced after sharding] in ``_materialize.py``.
        """
        if self.state is not TrainingState.IDLE or self.backward_active:
            raise FullyShardError(f"{what} during forward/backward; call it between steps.")
        for unit in self.units:
            if unit.state is not ShardedState.SHARDED:
                unit.reshard()
            unit.refresh(what)
