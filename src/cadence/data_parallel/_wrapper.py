"""`DataParallel`: bucketed all-reduce overlapped with backward, finalized when the caller says.

See [Note: DP reduction windows] in ``_reducer.py`` for the state machine.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from cadence._grad_timing import autograd as _autograd
from cadence._grad_timing.timing import check_split_part, refuse_inside_backward
from cadence._groups.dp_layout import DataParallelGroup, DataParallelLayout
from cadence._groups.exchange import check_algorithms
from cadence._modules.conversions import conversion_name
from cadence.comm import CollectiveAlgorithms, Comm, EventLog, ReductionHandle
from cadence.data_parallel import comm_hooks
from cadence.data_parallel._buckets import build_buckets
from cadence.data_parallel._ddp_args import UNSET, DDPPlan, resolve_ddp_args
from cadence.data_parallel._errors import DataParallelError
from cadence.data_parallel._join import JoinableDataParallel, join_forward, refuse_inside_join
from cadence.data_parallel._overlap import OverlapOptimizer, OverlappedOptimizers
from cadence.data_parallel._pickling import pickled_state
from cadence.data_parallel._reducer import ForwardToken, Reducer, WindowState
from cadence.data_parallel._replica import Replica, sparse_gradient_indices, wrapped_parameters
from cadence.data_parallel._sink import Sink, used_params
from cadence.data_parallel.comm_hooks import check_comm_hook
from cadence.errors import CadenceValueError

__all__ = ["DataParallel"]

_Named = list[tuple[str, nn.Parameter]]  # (name, parameter): the wrapped ones, in order
_ACCUMULATE_OUTSIDE_JOIN = (
    "accumulate gradients outside the join context, or give every rank the same number "
    "of micro-steps per optimizer step."
)


_NO_DDP_LOGGING = (
    "DataParallel.{}: cadence does not keep torch DDP's runtime logging data (its C++ "
    "Logger's sampled timings and bucket statistics). The collectives, with their bytes and "
    "issue, wait and completion times, are in dp.event_log (a cadence.EventLog); the "
    "buckets in dp.bucket_param_names()."
)


class DataParallel(nn.Module, JoinableDataParallel, OverlapOptimizer):
    """Replicated data parallelism with caller-controlled gradient finalization.

    Gradients are packed into buckets in the order they arrive (reverse
    registration order, a small first bucket), whose all-reduces launch
    asynchronously during backward as soon as each bucket is ready, in the same
    order on every rank.

    Finalization (wait + write the averaged gradients into ``.grad``):
    - automatic (default): at the end of the outermost backward, as torch DDP;
    - manual (``require_manual_backward_finalization = True``): backward only
      launches; call ``finalize_backward()`` (blocking) or
      ``finalize_backward(async_op=True)`` (returns a `ReductionHandle`) when
      you want the result, e.g. after sparse work or from a backward hook.

    Accepts torch ``DistributedDataParallel``'s whole constructor signature, in
    its order (see [Note: DDP arguments] in ``_ddp_args.py`` for what each does),
    plus cadence's keyword-only options.

    Args:
        module: the model replica.
        device_ids, output_device, dim, broadcast_buffers, init_sync, process_group,
            bucket_cap_mb, find_unused_parameters, check_reduction,
            gradient_as_bucket_view, static_graph, delay_all_reduce_named_params,
            param_to_hook_all_reduce, mixed_precision, device_mesh,
            skip_all_reduce_unused_params, bucket_cap_mb_list, batched_grad_copy,
            forward_sync_buffers: as torch DDP. Notably ``bucket_cap_mb`` caps every
            bucket; left at None, the first bucket (reduced last) gets 1 MiB and the
            others 25 MiB. ``find_unused_parameters`` costs one extra small all-reduce
            per step; ``static_graph`` learns the used parameters on the first synced
            step (no overlap on that step).
        group: the data-parallel group to all-reduce over: None (the world), a
            ProcessGroup, a `ParallelGroups` (its flattened ``dp`` group) or a 1-D or
            2-D DeviceMesh (flattened). See [Note: the meaning of group=] in
            ``cadence/topology.py``; fully_shard reads it the same way.
            ``process_group=`` and ``device_mesh=`` are DDP's spellings of it.
        first_bucket_cap_mb: cap of the first bucket launched, holding the
            last-registered parameters (default: DDP's rule above).
        reduce_dtype: dtype on the wire (e.g. ``torch.bfloat16``); ``.grad`` keeps
            the parameter dtype, so accumulation stays in full precision.
        event_log: record collectives here (otherwise a log bounded to the newest
            4096 events is kept as ``dp.event_log``). Gradient all-reduces are logged
            under the group name ``dp``, `join` bookkeeping under ``dp.join``.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[Any] | None = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: DeviceMesh | None = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        group: DataParallelGroup = None,
        first_bucket_cap_mb: float | None = UNSET,
        reduce_dtype: torch.dtype | None = None,
        event_log: EventLog | None = None,
    ) -> None:
        super().__init__()
        # What rebuilds this wrapper when it is unpickled (see [Note: pickling a
        # wrapper]): every argument but the group, which must be the default one.
        self._init_kwargs: dict[str, Any] = {
            "device_ids": device_ids,
            "output_device": output_device,
            "dim": dim,
            "broadcast_buffers": broadcast_buffers,
            "bucket_cap_mb": bucket_cap_mb,
            "find_unused_parameters": find_unused_parameters,
            "check_reduction": check_reduction,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
            "delay_all_reduce_named_params": delay_all_reduce_named_params,
            "param_to_hook_all_reduce": param_to_hook_all_reduce,
            "mixed_precision": mixed_precision,
            "skip_all_reduce_unused_params": skip_all_reduce_unused_params,
            "bucket_cap_mb_list": bucket_cap_mb_list,
            "batched_grad_copy": batched_grad_copy,
            "forward_sync_buffers": forward_sync_buffers,
            "reduce_dtype": reduce_dtype,
        }
        if first_bucket_cap_mb is not UNSET:  # a sentinel: its identity does not survive a pickle
            self._init_kwargs["first_bucket_cap_mb"] = first_bucket_cap_mb
        plan = resolve_ddp_args(
            module,
            group=group,
            device_ids=device_ids,
            output_device=output_device,
            dim=dim,
            broadcast_buffers=broadcast_buffers,
            init_sync=init_sync,
            process_group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            bucket_cap_mb_list=bucket_cap_mb_list,
            first_bucket_cap_mb=first_bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            check_reduction=check_reduction,
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            mixed_precision=mixed_precision,
            reduce_dtype=reduce_dtype,
            device_mesh=device_mesh,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            forward_sync_buffers=forward_sync_buffers,
        )
        named = wrapped_parameters(module, plan.ignored, plan.reduce_dtype, gradient_as_bucket_view)
        self.module = module
        self._init_comm(plan, event_log)
        self._init_attributes(plan, named, dim, gradient_as_bucket_view)
        if plan.init_sync:
            self._verify_and_broadcast(named, with_buffers=plan.init_sync_buffers)
        self._build_reducer(plan, named, find_unused_parameters, static_graph)
        self._install_hooks(named)

    # -- pickling ---------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """``torch.save(model)`` and ``copy.deepcopy``: see [Note: pickling a wrapper]."""
        return pickled_state(self, self._init_kwargs)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # The constructor again, without its collectives: this may run on one rank.
        self.__init__(state["module"], **{**state["init_kwargs"], "init_sync": False})  # type: ignore[misc]
        for name, value in state["flags"].items():
            setattr(self, name, value)

    # -- construction ---------------------------------------------------------

    def _init_comm(self, plan: DDPPlan, event_log: EventLog | None) -> None:
        """The group, the event log and the communicators: everything after this talks."""
        layout = DataParallelLayout.of(plan.group, who="DataParallel")
        # Without a caller's log, keep a bounded one: stats() and debugging need recent
        # events, but a million-step run must not grow memory without bound.
        self.event_log = event_log if event_log is not None else EventLog(capacity=4096)
        self.process_group = layout.dp_group()
        self._comm = Comm(self.process_group, event_log=self.event_log, name="dp")
        self._init_join(ignored=plan.ignored)

    def _init_attributes(self, plan: DDPPlan, named: _Named, dim: int, as_view: bool) -> None:
        """DDP's public attributes, as scripts read them, and the wrapper's own flags."""
        self.device_ids = plan.device_ids
        self.output_device = plan.output_device
        self.dim = dim
        self.device = named[0][1].device
        self.broadcast_buffers = plan.forward_sync_buffers
        self.require_forward_param_sync = True
        self._input_device = plan.input_device
        # See [Note: module methods after wrapping] in _replica.py.
        self._replica = Replica(self.module, named, set(plan.ignored))
        self._gradient_as_bucket_view = as_view
        self._no_sync_depth = 0
        self._is_last_backward = True

    def _build_reducer(self, plan: DDPPlan, named: _Named, find_unused: bool, static: bool) -> None:
        """The bucket plan and the reducer that runs it, built once the replicas agree."""
        index = {n: i for i, (n, _) in enumerate(named)}
        delayed = frozenset(index[n] for n in plan.delayed if n in index)
        sparse = sparse_gradient_indices(self.module, named)
        if delayed & sparse:
            raise CadenceValueError(
                f"delay_all_reduce_named_params names '{named[min(delayed & sparse)][0]}', whose "
                "gradient is sparse (an embedding with sparse=True): sparse gradients are "
                "reduced one per bucket and cannot join the delayed dense bucket. Fix: leave "
                "it out of delay_all_reduce_named_params."
            )
        buckets = build_buckets(
            named,
            bucket_caps_mb=plan.bucket_caps_mb,
            reduce_dtype=plan.reduce_dtype,
            delayed=delayed,
            sparse=sparse,
        )
        self.bucket_bytes_cap = int(plan.bucket_caps_mb[-1] * 1024 * 1024)
        self._reducer = Reducer(
            buckets,
            named,
            self._comm,
            find_unused_parameters=find_unused,
            static_graph=static,
            gradient_as_bucket_view=self._gradient_as_bucket_view,
        )
        self._reducer.explain = self._replica.explain
        self._overlap = OverlappedOptimizers(self._reducer, self.event_log)

    def _install_hooks(self, named: _Named) -> None:
        """Last, on a complete wrapper: each hook feeds the reducer as a gradient lands."""
        self._index_of = {id(p): i for i, (_, p) in enumerate(named)}
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._reducer.on_grad_ready(i))
            for i, (_, p) in enumerate(named)
        ]
        if self._gradient_as_bucket_view:
            self._attach_bucket_views()

    @property
    def _buffers_to_sync(self) -> list[torch.Tensor]:
        """The buffers the forward broadcasts, looked up now: conversions replace them."""
        return self._replica.buffers()

    def _verify_and_broadcast(self, named: _Named, *, with_buffers: bool) -> None:
        if self._comm.world_size == 1:
            return
        # A digest vote, whatever the world; the lists travel (as JSON) only when they
        # differ, to name the difference. See [Note: agreeing by digest].
        mine = [[n, list(p.shape), str(p.dtype)] for n, p in named]
        encoded = json.dumps(mine).encode()
        if self._comm.agree(encoded).same:
            everyone = [mine]
        else:
            everyone = [json.loads(b) for b in self._comm.all_gather_bytes(encoded)]
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                diff = next(
                    (f"{a} vs {b}" for a, b in zip(everyone[0], theirs) if a != b),
                    f"{len(everyone[0])} vs {len(theirs)} parameters",
                )
                raise CadenceValueError(
                    f"DataParallel: rank {rank} has different parameters than rank 0 ({diff}). "
                    "Every rank must wrap an identical model."
                )
        with torch.no_grad():
            self._broadcast_tensors([p for _, p in named])
            if with_buffers:
                self._broadcast_tensors(self._buffers_to_sync)

    def _broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        # One broadcast per dtype (coalesced), not one per tensor.
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self._comm.broadcast(flat, src=src)
            offset = 0
            for t in group:
                t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def _attach_bucket_views(self) -> None:
        keep_none = self._reducer.keeps_grads_none
        for bucket in self._reducer.buckets:
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is None and keep_none:
                    continue  # see Reducer.keeps_grads_none
                if p.grad is None:
                    view.zero_()
                    p.grad = view
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view

    # -- timing API -------------------------------------------------------------

    @property
    def require_manual_backward_finalization(self) -> bool:
        return self._reducer.manual

    @require_manual_backward_finalization.setter
    def require_manual_backward_finalization(self, enabled: bool) -> None:
        self.set_manual_backward_finalization(enabled)

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Backward launches reductions; the caller finalizes (see `finalize_backward`)."""
        refuse_inside_backward(
            "set_manual_backward_finalization()",
            "the end-of-backward callback reads the mode.",
            DataParallelError,
        )
        if enabled:
            refuse_inside_join(
                self,
                "require_manual_backward_finalization=True",
                "finalize automatically inside the join context.",
            )
        if not enabled and self._reducer.pending:
            raise DataParallelError(
                "cannot turn manual finalization off while reductions are pending; call "
                "finalize_backward() first."
            )
        if not enabled and self._reducer.held:
            raise DataParallelError(
                f"cannot turn manual finalization off while {self._reducer.held} bucket(s) "
                "are held for finalize_backward(); call dp.hold_last_buckets(0) first."
            )
        self._reducer.manual = bool(enabled)

    def set_collective_algorithms(self, algorithms: CollectiveAlgorithms) -> None:
        """How bucket all-reduces run on gloo (default: gloo's own, as DDP; NCCL always
        its own). Exchange is opt-in: above world 2 it moves more bytes, and it measured
        slower inside a step (docs/benchmarks.md, "Where the time goes"). Call on every
        rank, between steps.
        """
        check_algorithms(algorithms, "DataParallel")
        why = "every rank must switch between the same two collectives."
        refuse_inside_backward("set_collective_algorithms()", why, DataParallelError)
        if self._reducer.pending:
            raise DataParallelError(
                "set_collective_algorithms() while reductions are pending; call "
                "finalize_backward() first."
            )
        self._comm.algorithms = self._join_comm.algorithms = algorithms

    @property
    def should_finalize_after_backward(self) -> bool:
        """After forward: will the coming backward leave reductions for the caller to finalize?

        True in manual mode when the backward will sync: the sync flag is on and the
        forward did not run inside ``no_sync()``.
        """
        token = self._reducer.last_token
        forward_no_sync = token is not None and token.no_sync
        return self._reducer.manual and self._reducer.require_sync and not forward_no_sync

    def set_requires_gradient_sync(self, enabled: bool, *, recurse: bool = True) -> None:
        """Whether backwards reduce. Read when each backward *starts*, not at forward.

        ``recurse`` is accepted for the shared verbs: DataParallel is one reduction
        unit with nothing nested, so both values set the flag of the whole wrapper.
        """
        refuse_inside_backward(
            "set_requires_gradient_sync()",
            "the sync decision of a backward is taken when it starts.",
            DataParallelError,
        )
        if not enabled:
            refuse_inside_join(self, "turning gradient sync off", _ACCUMULATE_OUTSIDE_JOIN)
        self._reducer.require_sync = bool(enabled)

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag, honoured: False makes backwards accumulate without reducing.

        The same flag as `set_requires_gradient_sync`. DDP reads it at forward; cadence
        reads it when the backward starts, so setting it before the forward (as
        scripts do) behaves identically.
        """
        return self._reducer.require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, enabled: bool) -> None:
        self.set_requires_gradient_sync(enabled)

    @property
    def forward_sync_buffers(self) -> bool:
        """torch DDP 2.13's name of ``broadcast_buffers`` (read at every forward)."""
        return self.broadcast_buffers

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, enabled: bool) -> None:
        self.broadcast_buffers = bool(enabled)

    def _syncs_buffers_at_forward(self) -> bool:
        return self._comm.world_size > 1 and self.will_sync_module_buffers()

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts buffers from rank 0 (as torch DDP)."""
        return bool(
            self.require_forward_param_sync and self.broadcast_buffers and self._buffers_to_sync
        )

    @property
    def gradient_as_bucket_view(self) -> bool:
        return self._gradient_as_bucket_view

    @property
    def find_unused_parameters(self) -> bool:
        return self._reducer.find_unused

    @property
    def static_graph(self) -> bool:
        return self._reducer.static_graph

    # DDP's private runtime logging (its C++ Logger): torch's own DDP tests and some
    # scripts call these. cadence keeps no such record; refused by name, with where the
    # same facts are, rather than an AttributeError that says nothing.
    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        raise DataParallelError(_NO_DDP_LOGGING.format("_set_ddp_runtime_logging_sample_rate"))

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        raise DataParallelError(_NO_DDP_LOGGING.format("_get_ddp_logging_data"))

    def _set_static_graph(self) -> None:
        """torch DDP's toggle: the graph is static from the next synced backward on."""
        if self._reducer.pending or _autograd.in_backward():
            raise DataParallelError(
                "_set_static_graph() while a backward or its reductions are pending; call it "
                "between steps (or pass static_graph=True to the constructor)."
            )
        refuse_inside_join(self, "_set_static_graph()", "call it outside the join context.")
        self._reducer.static_graph = True

    def set_is_last_backward(self, is_last: bool) -> None:
        """FSDP2's verb, for one-line switching: DataParallel always finalizes each synced backward.

        fully_shard may leave a non-last backward's reductions in flight; DataParallel
        cannot, because every backward reuses the same bucket buffers, so a synced
        backward is always finalized (automatically or by you). The gradients are the
        same either way; the flag is recorded (``is_last_backward``) and changes nothing.
        """
        self._is_last_backward = bool(is_last)

    @property
    def is_last_backward(self) -> bool:
        return self._is_last_backward

    def set_reshard_after_forward(self, enabled: bool, *, recurse: bool = True) -> None:
        """FSDP2's verb, for one-line switching: nothing is sharded here, so nothing to do."""

    def set_reshard_after_backward(self, enabled: bool, *, recurse: bool = True) -> None:
        """FSDP2's verb, for one-line switching: nothing is sharded here, so nothing to do."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP-compatible: backwards inside, and backwards of forwards run inside, accumulate."""
        refuse_inside_join(self, "no_sync()", _ACCUMULATE_OUTSIDE_JOIN)
        previous = self._reducer.require_sync
        self._reducer.require_sync = False
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1
            self._reducer.require_sync = previous

    def finalize_backward(self, *, async_op: bool = False) -> ReductionHandle | None:
        """Wait for the gradient all-reduces and write the averaged grads into ``.grad``.

        - After backward: launches any bucket not yet launched, then waits.
        - Inside backward (e.g. a tensor hook): allowed once every bucket has launched
          (see [Note: finalize inside backward] in ``cadence/_grad_timing/timing.py``).
        - After ``no_sync`` accumulation with sync re-enabled: reduces the accumulated
          grads once (deferred reduction), no extra forward/backward needed.
        - Nothing pending: issues no collective.

        Blocking, returns None. With ``async_op=True`` returns a `ReductionHandle`
        (already completed when nothing was pending); ``.grad`` is valid after
        ``handle.wait()``, which must happen before the next forward.
        """
        handle = self._reducer.finalize(blocking=not async_op)
        if async_op and handle is None:
            return ReductionHandle.completed("DataParallel gradients")
        return handle

    def hold_last_buckets(self, n: int, *, only_while_busy: bool = False) -> None:
        """Leave the last ``n`` buckets (the ones backward fills last) for
        `finalize_backward` to launch, instead of launching them in backward.

        For a collective of the caller's own that should have the wire first: launch it
        after backward, wait for it, and then finalize. It no longer shares the link to
        the end with every bucket, and whatever follows it (an embedding's sparse step)
        runs while the held buckets reduce (see [Note: held buckets] in _reducer.py).
        The gradients, their bytes and their values are unchanged. Manual finalization
        only: the automatic one launches every bucket when backward ends anyway.
        ``hold_last_buckets(0)`` releases. Call on every rank, between steps.

        ``only_while_busy=True`` holds a bucket only while an earlier one is still in
        flight: one that is ready when all have landed launches in backward, since
        holding it would leave the wire idle. The hold then follows the link's speed
        (on a fast link nothing waits); because the launch time then differs by rank,
        run your collective on another process group than the wrapper's.
        """
        refuse_inside_backward("hold_last_buckets()", "backward reads it.", DataParallelError)
        buckets = len(self._reducer.buckets)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= buckets:
            raise DataParallelError(
                f"hold_last_buckets(n) takes a whole number from 0 to num_buckets "
                f"({buckets}); got {n!r}."
            )
        if n and not self._reducer.manual:
            raise DataParallelError(
                "hold_last_buckets() holds buckets for finalize_backward(), but finalization "
                "is automatic: it launches every bucket when backward ends. Set "
                "require_manual_backward_finalization = True first."
            )
        if self._reducer.pending:
            raise DataParallelError(
                "hold_last_buckets() while reductions are pending; call finalize_backward() first."
            )
        if not isinstance(only_while_busy, bool):
            raise DataParallelError(
                f"hold_last_buckets(n, only_while_busy=...) takes True or False; got "
                f"{only_while_busy!r}."
            )
        self._reducer.held = n
        self._reducer.hold_only_while_busy = only_while_busy and n > 0

    @property
    def held_buckets(self) -> int:
        """How many of the last buckets wait for `finalize_backward` (`hold_last_buckets`)."""
        return self._reducer.held

    @held_buckets.setter
    def held_buckets(self, n: int) -> None:
        self.hold_last_buckets(n, only_while_busy=self.holds_only_while_busy)

    @property
    def holds_only_while_busy(self) -> bool:
        """Whether the held buckets wait only while an earlier one is in flight
        (`hold_last_buckets`'s ``only_while_busy``)."""
        return self._reducer.hold_only_while_busy

    @holds_only_while_busy.setter
    def holds_only_while_busy(self, flag: bool) -> None:
        self.hold_last_buckets(self.held_buckets, only_while_busy=flag)

    @contextlib.contextmanager
    def split_backward(self, part: str) -> Iterator[None]:
        """One part (``"input"`` or ``"weight"``) of a backward split in two.

        ``"input"``: the backward inside computes input gradients only; no reduction
        window is armed. ``"weight"``: the autograd calls inside are the parameter half
        of one backward; buckets launch as their gradients become ready, following
        the sync flag read at entry. See [Note: split backward parts] in
        ``cadence/_grad_timing/timing.py``.
        """
        check_split_part(part, self._reducer.split_part, DataParallelError)
        refuse_inside_join(self, "split_backward()", "run whole backwards inside the join context.")
        self._reducer.begin_split_part(part)
        try:
            yield
        except BaseException:
            self._reducer.split_part = None  # a failed part ends nothing: reset_iter_state()
            raise
        self._reducer.end_split_part()

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Make ``optimizer.step()`` raise while reductions are pending (before it reads grads)."""

        def _check(opt: Any, *_: Any) -> None:
            if not self._overlap.owns(opt):  # an overlapped opt.step() finishes what is pending
                self._reducer.check_can_start("optimizer.step()")

        return optimizer.register_step_pre_hook(_check)

    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """Replace the all-reduce of each bucket (torch DDP signature; one hook per wrapper).

        The hook is checked here as DDP checks it (``TypeError`` if it is not callable,
        ``ValueError`` for a wrong annotation); one returning neither a Future nor a
        work object raises at the backward that calls it.
        """
        check_comm_hook(hook)
        if self._reducer.comm_hook is not None:
            raise DataParallelError(
                "register_comm_hook or register_builtin_comm_hook can only be called once. "
                "Fix: compose the hooks into one function and register that."
            )
        if self._reducer.pending:
            raise DataParallelError(
                "register_comm_hook() cannot be called while reductions are pending"
            )
        self._reducer.comm_hook = (state, hook)
        self._reducer.wire_divide = False  # hooks get un-divided buckets (DDP contract)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch DDP's private spelling for its built-in hooks, mapped to cadence's own."""
        hooks = {
            dist.BuiltinCommHookType.ALLREDUCE: comm_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: comm_hooks.fp16_compress_hook,
        }
        if comm_hook_type not in hooks:
            raise CadenceValueError(
                f"unknown built-in comm hook {comm_hook_type!r}; use one of "
                "dist.BuiltinCommHookType.ALLREDUCE or FP16_COMPRESS"
            )
        self.register_comm_hook(None, hooks[comm_hook_type])

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
        module: nn.Module, params_and_buffers_to_ignore: Sequence[str]
    ) -> None:
        """torch DDP's way to mark names that the wrapper leaves alone (read at wrapping)."""
        # The same attributes DDP sets, so either wrapper (and FSDP) honours the mark.
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore  # type: ignore[assignment]  # DDP's own ad-hoc attribute
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if name in params_and_buffers_to_ignore:
                t._ddp_ignored = True  # type: ignore[attr-defined]  # DDP's own ad-hoc attribute

    def reset_iter_state(self) -> None:
        """Drop window state after an exception in backward or finalize (call on every rank)."""
        self._reducer.reset()

    def reset(self) -> None:
        """Deprecated spelling of `reset_iter_state` (the name fully_shard shares)."""
        warnings.warn(
            "DataParallel.reset() is deprecated; call reset_iter_state(), the name every "
            "cadence wrapper shares",
            DeprecationWarning,
            stacklevel=2,
        )
        self.reset_iter_state()

    # -- nn.Module methods (see [Note: module methods after wrapping] in _replica.py) --

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """Conversions that keep the wrapped parameters' dtype and device; others refused."""
        what = f"{conversion_name()}()"
        if self._reducer.pending:
            raise DataParallelError(
                f"{what} while gradient reductions are pending; call finalize_backward() first."
            )
        self._replica.refuse_conversion(fn, what)
        out = super()._apply(fn, recurse=recurse)  # type: ignore[no-untyped-call]  # torch leaves Module._apply unannotated
        self._replica.check(what)
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if assign:
            raise DataParallelError(
                "load_state_dict(assign=True) would replace the parameters DataParallel's "
                "gradient hooks and buckets are bound to, so their gradients would never be "
                "all-reduced. Fix: use assign=False (the default), which copies the values "
                "in, or load into the model before wrapping it."
            )
        return super().load_state_dict(state_dict, strict=strict)

    # -- state ------------------------------------------------------------------

    @property
    def state(self) -> WindowState:
        return self._reducer.state

    @property
    def pending(self) -> bool:
        return self._reducer.pending

    @property
    def num_buckets(self) -> int:
        return len(self._reducer.buckets)

    def bucket_param_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [list(b.names) for b in self._reducer.buckets]

    def stats(self) -> dict[str, float]:
        """Collective counts, bytes, and communication time hidden vs exposed (seconds)."""
        log = self.event_log
        events = log.collectives("all_reduce")
        return {
            "all_reduces": float(len(events)),
            "bytes": float(sum(e.nbytes for e in events)),
            "exposed_s": log.wait_time("all_reduce"),
            "overlapped_s": log.in_flight_time("all_reduce"),
        }

    # -- forward ----------------------------------------------------------------

    def _to_input_device(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device != self._input_device:
            return x.to(self._input_device, non_blocking=True)
        return x

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self._reducer.check_can_start("the next forward")
            self._replica.check_unfrozen("DataParallel forward")
            self._overlap.check_forward()
        if self._gradient_as_bucket_view:
            self._attach_bucket_views()
        if self._join_config.enable:
            join_forward(self)  # buffers come from the newest active rank, see _join.py
        elif self._syncs_buffers_at_forward():
            with torch.no_grad():
                self._broadcast_tensors(self._buffers_to_sync)
        if self._input_device is not None:  # device_ids=[i]: inputs move there, as DDP
            args, kwargs = pytree.tree_map(self._to_input_device, (args, kwargs))
        out = self.module(*args, **kwargs)
        # As torch DDP's post-forward: the next forward broadcasts buffers only after a
        # forward that was to sync gradients (one under no_sync(), with the flag off, or
        # without grad skips it), so both issue the same broadcasts.
        self.require_forward_param_sync = (
            torch.is_grad_enabled() and self.require_backward_grad_sync and not self._no_sync_depth
        )
        if not torch.is_grad_enabled():
            return out
        flat, spec = pytree.tree_flatten(out)
        positions = [
            i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        # Only the context manager is recorded: the setter is read when backward starts.
        token = ForwardToken(no_sync=self._no_sync_depth > 0)
        self._reducer.last_token = token
        if not positions:
            return out
        tensors = [flat[i] for i in positions]
        if self._reducer.find_unused:
            token.used = used_params(tensors, self._index_of)
        sunk = Sink.apply(self._reducer, token, *tensors)
        for i, t in zip(positions, sunk):
            flat[i] = t
        return pytree.tree_unflatten(flat, spec)
