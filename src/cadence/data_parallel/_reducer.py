"""The gradient-reduction state machine behind `DataParallel`.

[Note: DP reduction windows]
A *window* is one backward pass as seen by the reducer. It is armed when the
backward starts: by the sink node on the wrapper's outputs (the first thing a
backward through the module runs, and always in the caller's graph task) or,
failing that, by the first parameter hook. The sync decision is read at that
moment, so a setter flipped between forward and backward takes effect (pipeline
schedules rely on this), and a forward inside ``no_sync()`` never syncs.

In a syncing window each parameter's post-accumulate hook marks it ready; a
bucket launches once all its parameters are ready *and* every earlier bucket has
launched, so every rank issues the same collectives in the same order. The
window is finalized (wait + write-back) either by the end-of-backward callback
(automatic mode, queued from the outermost graph task so reentrant checkpointing
cannot finalize early) or by the caller (`finalize_backward`).

A non-syncing window only accumulates into ``.grad``; the reduction is owed
and paid by the next syncing backward or by `finalize_backward` with sync on.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cadence._grad_timing import autograd as _autograd
from cadence._grad_timing.pending_grad import GradGuard
from cadence.comm import Comm, CommWork, ReductionHandle, phase
from cadence.data_parallel._buckets import Bucket, empty_sparse_like
from cadence.data_parallel._errors import DataParallelError
from cadence.data_parallel.comm_hooks import GradBucket, hook_result_error, is_future

__all__ = ["DataParallelError", "ForwardToken", "FutureWork", "Reducer", "WindowState"]


class WindowState(enum.Enum):
    IDLE = "idle"
    ACCUMULATING = "accumulating"  # local grads owe a reduction
    REDUCING = "reducing"  # a syncing window has launched some buckets
    LAUNCHED = "launched"  # every bucket launched, not yet finalized
    FAILED = "failed"


@dataclass
class ForwardToken:
    """What one forward recorded for the backward that follows it."""

    no_sync: bool
    used: set[int] | None = None  # param indices reachable from the outputs (find_unused)


@dataclass
class _Window:
    sync: bool
    deferred: bool = False  # opened by finalize_backward to pay an owed reduction
    ended: bool = False  # the end-of-backward callback ran (the backward did not raise)
    counts: dict[int, int] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)  # params still owed per bucket
    works: list[CommWork | None] = field(default_factory=list)
    next_bucket: int = 0
    landed: int = 0  # every bucket before it has completed (see [Note: held buckets])
    used_map_work: CommWork | None = None
    used_map: torch.Tensor | None = None
    learning: bool = False  # static_graph's first synced iteration
    fast: bool = False  # see [Note: the hook's fast path]
    written: set[int] = field(default_factory=set)  # buckets written back one by one
    task: int = -1  # the autograd graph task that armed it (-1: armed outside backward)
    premarked: set[int] = field(default_factory=set)  # find_unused: marked ready as unused


# What a comm hook's future yields: the reduced buffer, or torch DDP's ``[buffer]``.
_HookValue = torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...] | None


class FutureWork:
    """Adapts a comm hook's ``torch.futures.Future`` to the `CommWork` interface."""

    def __init__(self, fut: torch.futures.Future[_HookValue], bucket: Bucket) -> None:
        self._fut = fut
        self._bucket = bucket
        self._done = False

    def is_completed(self) -> bool:
        return self._done or self._fut.done()

    def wait(self) -> None:
        if self._done:
            return
        value = self._fut.wait()
        result = value[0] if isinstance(value, (list, tuple)) else value
        if self._bucket.sparse and result is not None:
            self._bucket.buffer = result  # see [Note: sparse buckets] in _buckets.py
        elif result is not None and result.data_ptr() != self._bucket.buffer.data_ptr():
            self._bucket.buffer.copy_(result.reshape(-1))
        self._done = True


class Reducer:
    """Owns the buckets, the current window and the hook logic. Not public."""

    def __init__(
        self,
        buckets: list[Bucket],
        params: list[tuple[str, torch.nn.Parameter]],
        comm: Comm,
        *,
        find_unused_parameters: bool,
        static_graph: bool,
        gradient_as_bucket_view: bool,
    ) -> None:
        self.buckets = buckets
        self.params = params
        self.comm = comm
        self.find_unused = find_unused_parameters
        self.static_graph = static_graph
        self.bucket_view = gradient_as_bucket_view
        self.param_bucket: dict[int, int] = {}
        for b in buckets:
            for i in b.param_indices:
                self.param_bucket[i] = b.index
        self.bucket_of = [self.param_bucket[i] for i in range(len(params))]
        # [Note: adopting bucket views]
        # Without gradient_as_bucket_view, torch DDP copies each gradient into its
        # bucket (scaled) at launch and copies the reduced bucket back into .grad
        # at the end: two passes over every gradient, plus a second copy of all
        # gradients held alive. Here the launch's scaled copy is the only pass: the
        # parameter then *adopts* its bucket view as .grad (the tensor autograd
        # made is dropped), so finalize has nothing to write back and the
        # gradients live once, in the buckets. The values are the same bits (the
        # same divide, the same all-reduce, read in place instead of copied).
        # Before finalize, .grad is unspecified, as it always was: the reduction
        # is in flight in it. Not done where the wire dtype differs from the
        # parameter's (reduce_dtype), with find_unused_parameters (a parameter no
        # rank used must keep its old .grad untouched, and its stale view would be
        # rescaled in place) or for a gradient that carries a graph (create_graph).
        # The cost, on CPU: the dropped tensor is freed mid-backward, and glibc returns
        # such blocks to the system and faults them in again (several times DDP's page
        # faults a step, docs/benchmarks.md); keeping it until the next forward would
        # avoid that at the price of the second copy adoption saves. Not done: the
        # step on an emulated link measured the same with adoption off.
        self.adopt = [
            not gradient_as_bucket_view
            and not find_unused_parameters
            and not b.sparse
            and all(p.dtype == b.buffer.dtype for p in b.params)
            for b in buckets
        ]
        self.expected_counts: dict[int, int] | None = None  # learned under static_graph
        self.static_unused: frozenset[int] = frozenset()  # ... and the globally unused ones
        self.comm_hook: tuple[Any, Callable[..., Any]] | None = None
        self.wire_divide = True  # pre-divide before SUM unless a custom hook owns averaging
        # Inside a join with divide_by_initial_world_size=False: the number of active
        # ranks this step (see [Note: DP join] in _join.py); None divides by the world.
        self.divisor: Callable[[], int] | None = None
        # The all-reduced used map of the last synced backward (find_unused_parameters):
        # what a joined rank contributes while it shadows, as torch DDP.
        self.last_used_map: torch.Tensor | None = None
        # - per-iteration state
        self.window: _Window | None = None
        self.accumulating = False
        self.handle: ReductionHandle | None = None
        self.failure: BaseException | None = None
        self.last_token: ForwardToken | None = None
        self.manual = False
        self.require_sync = True
        # How many of the last buckets (in launch order) backward leaves for
        # finalize_backward to launch (see [Note: held buckets]).
        self.held = 0
        # Whether a held bucket launches in backward anyway once every launched bucket
        # has landed (see [Note: held buckets]).
        self.hold_only_while_busy = False
        # See [Note: gradients appear at finalization] in cadence/_grad_timing/pending_grad.py.
        self.grad_guard = GradGuard("DataParallel")
        self.split_part: str | None = (
            None  # see [Note: split backward parts] in _grad_timing/timing.py
        )
        # Called with a bucket's index once its reduced gradients are in .grad (see
        # [Note: stepping buckets as they complete]); None: one write-back at the end.
        self.on_bucket_reduced: Callable[[int], None] | None = None
        # Says what happened to the named parameters when their gradients go wrong (see
        # [Note: module methods after wrapping] in _replica.py); "" if it cannot tell.
        self.explain: Callable[[list[str]], str] = lambda names: ""

    # -- state queries --------------------------------------------------------

    @property
    def state(self) -> WindowState:
        if self.failure is not None:
            return WindowState.FAILED
        w = self.window
        if w is not None and w.sync:
            return (
                WindowState.LAUNCHED if w.next_bucket == len(self.buckets) else WindowState.REDUCING
            )
        if self.accumulating:
            return WindowState.ACCUMULATING
        return WindowState.IDLE

    @property
    def pending(self) -> bool:
        """A syncing window (or an un-waited handle) has not been finalized."""
        w = self.window
        return (w is not None and w.sync) or (self.handle is not None and not self.handle.done)

    # -- errors raised before any collective ----------------------------------

    def check_can_start(self, what: str) -> None:
        if self.failure is not None:
            raise DataParallelError(
                f"cannot run {what}: a previous backward or finalize_backward failed "
                f"({type(self.failure).__name__}: {self.failure}). Other ranks may be blocked "
                "in a collective. Call dp.reset_iter_state() on every rank before continuing."
            )
        if self.handle is not None and not self.handle.done:
            raise DataParallelError(
                f"cannot run {what}: finalize_backward(async_op=True) returned a handle that "
                "has not been waited. Call handle.wait() first."
            )
        w = self.window
        # A window whose end-of-backward callback never ran (and that is not the one
        # running now) belongs to a backward that raised.
        running = _autograd.in_backward()
        if w is not None and w.sync and not w.ended and not w.deferred and not running:
            raise DataParallelError(
                f"cannot run {what}: the previous backward did not finish (it probably "
                f"raised) after launching {w.next_bucket} of {len(self.buckets)} bucket "
                "all-reduces, so they were never finalized. Fix: call dp.reset_iter_state() "
                "on every rank first."
            )
        if w is not None and w.sync:
            raise DataParallelError(
                f"cannot run {what}: the previous synced backward launched its gradient "
                f"all-reduces ({w.next_bucket} of {len(self.buckets)} buckets) but they were "
                "never finalized. With require_manual_backward_finalization=True, call "
                "dp.finalize_backward() (or wait its handle) after backward and before the "
                "next forward or optimizer.step()."
            )

    # -- window lifecycle -------------------------------------------------------

    def begin_backward(self, token: ForwardToken | None) -> None:
        """Arm a window; called by the sink (or by the first hook as a fallback)."""
        if self.split_part == "input":
            return  # no parameter gradient is coming: nothing to reduce
        w = self.window
        if self.split_part == "weight" and w is not None:
            return  # armed when the weight part began; its autograd calls share it
        task = _autograd.current_graph_task_id()
        if w is not None and not w.ended and task != -1 and w.task == task:
            self._another_output(w, token)
            return
        if w is not None and w.sync:
            raise DataParallelError(
                "a new backward started while the previous synced backward's reductions are "
                "still pending. Call dp.finalize_backward() between the two backwards, or run "
                "the earlier ones with set_requires_gradient_sync(False) / no_sync()."
            )
        no_sync = token.no_sync if token is not None else False
        sync = self.require_sync and not no_sync
        window = _Window(sync=sync, task=task)
        self.window = window
        if task != -1:
            _autograd.queue_callback(self.end_backward)
        if not sync:
            return
        window.pending = [len(b.params) for b in self.buckets]
        window.works = [None] * len(self.buckets)
        if self.static_graph and self.expected_counts is None:
            window.learning = True
            return
        window.fast = self.expected_counts is None
        if self.find_unused and token is not None and token.used is not None:
            for i in range(len(self.params)):
                if i not in token.used:
                    self._mark_ready(i)
                    window.premarked.add(i)
        if self.expected_counts is not None:
            for i, n in self.expected_counts.items():
                if n == 0:
                    self._mark_ready(i)
        self._launch_ready()

    def _another_output(self, w: _Window, token: ForwardToken | None) -> None:
        """A second output of the wrapper reached by the backward that armed ``w``.

        [Note: several forwards, one backward]
        ``loss = f(model(a)) + g(model(b)); loss.backward()`` runs one sink per
        forward inside one graph task: one backward, one window, as under DDP. With
        ``find_unused_parameters`` the parameters this forward used are no longer
        unused: their early "ready" marks are taken back, which is possible while
        their buckets have not launched (the sinks run before any parameter's
        gradient, as they sit right after the loss).
        """
        if not w.sync or token is None or token.used is None or not w.premarked:
            return
        for i in sorted(w.premarked & token.used):
            b = self.param_bucket[i]
            if w.works[b] is not None:
                raise DataParallelError(
                    f"parameter '{self.params[i][0]}' was taken as unused by this backward and "
                    "its bucket was reduced, but another output of the wrapper that uses it "
                    "reached the same backward later. Fix: sum the outputs' losses before "
                    "calling backward on them, or use find_unused_parameters=False."
                )
            w.pending[b] += 1
            w.premarked.discard(i)

    def on_grad_ready(self, index: int) -> None:
        """Post-accumulate-grad hook of parameter ``index``.

        [Note: the hook's fast path]
        This runs once per parameter per backward on the compute thread, between
        autograd nodes, so its Python cost is paid in full on the critical path
        (torch DDP does the same bookkeeping in C++). The common case, a syncing
        window that is not learning a static graph, with every parameter expected
        once and this one seen for the first time, takes the short branch: a dict
        store, a list decrement, and a launch only when this parameter completes
        the next bucket in launch order. That is exactly what the general branch
        below does for it (``_launch_ready`` would find nothing to launch
        otherwise: after every hook the next bucket still owes a gradient).
        """
        w = self.window
        if w is not None and w.fast and index not in w.counts:
            w.counts[index] = 1
            b = self.bucket_of[index]
            pending = w.pending
            pending[b] -= 1
            if pending[b] <= 0 and b == w.next_bucket:
                self._launch_ready()
            elif self.hold_only_while_busy and b > w.next_bucket:
                self._launch_ready()  # a ready held bucket may go if the wire went idle
            return
        if w is None:
            self.begin_backward(self.last_token)
            w = self.window
            assert w is not None
        if not w.sync:
            self.accumulating = True
            return
        count = w.counts.get(index, 0) + 1
        w.counts[index] = count
        if w.learning:
            return
        expected = self.expected_counts.get(index, 1) if self.expected_counts else 1
        bucket = self.param_bucket[index]
        if count > expected:
            if w.works[bucket] is not None:
                name = self.params[index][0]
                self.failure = DataParallelError(
                    f"gradient of parameter '{name}' was accumulated {count} times in one "
                    f"backward, after its bucket's all-reduce had launched (expected {expected}). "
                    "This happens with reentrant activation checkpointing or a module used "
                    "twice. Use DataParallel(static_graph=True), or "
                    "torch.utils.checkpoint(..., use_reentrant=False)."
                )
                raise self.failure
            return
        if count == expected:
            self._mark_ready(index)
            self._launch_ready()

    def _mark_ready(self, index: int) -> None:
        w = self.window
        assert w is not None
        w.pending[self.param_bucket[index]] -= 1

    def _launch_ready(self) -> None:
        """Launch, in order, every bucket whose gradients are all ready.

        [Note: held buckets]
        ``held`` (``DataParallel.hold_last_buckets``) stops backward before the last
        ``held`` buckets: they launch when the caller finalizes. Between the end of
        backward and ``finalize_backward()``, a collective the caller launches (the
        sparse exchange of an embedding outside the wrapper, say) has the wire to itself
        but for the buckets already in flight, so it lands first and its own work (the
        sparse step) can run while the held buckets fly. Without the hold, every bucket
        is queued on the wire before backward returns, and the caller's collective,
        which can only start after backward, shares the wire to the end and finishes
        last. Only the launch time moves: the buckets, their bytes and the values are
        the same.

        How many to hold depends on the link: enough that what backward launched keeps
        the wire busy until it ends. On a link that keeps up with backward, every
        launched bucket lands early and a held one only waits on an idle wire.
        ``hold_only_while_busy`` makes the hold follow the link: a held bucket that is
        ready when every launched bucket has landed launches at once (at a later
        gradient's hook, or when backward ends), so only the buckets that would have
        queued behind the others wait. Whether a bucket has landed is read on the
        compute thread, at the hooks: a launch from a completion callback would issue
        collectives on another thread, in an order that may differ by rank. The
        launch time of a held bucket then differs by rank, so the caller's collective
        must run on another process group than the wrapper's (it should anyway: on
        the same group it queues behind the buckets).
        """
        w = self.window
        assert w is not None
        buckets = self.buckets
        while (
            w.next_bucket < len(buckets)
            and w.pending[w.next_bucket] <= 0
            and not buckets[w.next_bucket].delayed  # launched by _flush, when backward ends
        ):
            if w.next_bucket >= len(buckets) - self.held and not (
                self.hold_only_while_busy and self._all_landed(w)
            ):
                break
            self._launch(w.next_bucket)
            w.next_bucket += 1
        if w.next_bucket == len(self.buckets) and self.find_unused and w.used_map_work is None:
            self._launch_used_map()

    def _all_landed(self, w: _Window) -> bool:
        """Whether every bucket launched so far has completed (never blocks)."""
        works = w.works
        while w.landed < w.next_bucket and (
            (work := works[w.landed]) is None or work.is_completed()
        ):
            w.landed += 1
        return w.landed == w.next_bucket

    def _launch(self, b: int) -> None:
        with phase("dp.bucket_launch"):  # the fill (or hook) and the all-reduce's issue
            self._launch_bucket(b)

    def _launch_bucket(self, b: int) -> None:
        bucket = self.buckets[b]
        w = self.window
        assert w is not None
        scale = self.wire_divide and self.comm_hook is None and self.comm.world_size > 1
        if not self.bucket_view or bucket.sparse:
            try:
                self._fill(b, scale)
            except RuntimeError as exc:  # e.g. a gradient of a dtype its bucket does not hold
                why = self.explain(bucket.names)
                if why:
                    raise DataParallelError(why) from exc
                raise
        else:
            if self.keeps_grads_none:  # else every .grad is its view since the forward
                with torch.no_grad():
                    self._into_views(bucket)
            if scale:
                bucket.buffer.div_(self._divide_by())
        if self.comm_hook is not None:
            state, hook = self.comm_hook
            result = hook(state, GradBucket(bucket, self.comm, is_last=b == len(self.buckets) - 1))
            if is_future(result):
                result = FutureWork(result, bucket)
            elif not callable(getattr(result, "wait", None)):
                self.failure = DataParallelError(hook_result_error(hook, result))
                raise self.failure
            w.works[b] = CommWork(result)
            return
        w.works[b] = self.comm.all_reduce(bucket.buffer, async_op=True)

    @property
    def keeps_grads_none(self) -> bool:
        """A parameter may end a synced backward with ``.grad`` None, as under DDP.

        With ``find_unused_parameters`` or ``static_graph`` a parameter that no rank
        used keeps its gradient as it was; so with ``gradient_as_bucket_view`` its view
        is not attached before backward (that would turn None into zeros, which an
        optimizer steps). Such a parameter's gradient is copied into its view at launch.
        """
        return self.find_unused or self.static_graph

    def _into_views(self, bucket: Bucket) -> None:
        """With bucket views: gradients not in their views yet are moved in (DDP does too)."""
        for v, p in zip(bucket.views, bucket.params):
            g = p.grad
            if g is None:
                v.zero_()  # reduced as zeros; .grad set at write-back unless unused by all
            elif g is not v and g.data_ptr() != v.data_ptr():
                v.copy_(g)
                p.grad = v

    def _fill(self, b: int, scale: bool) -> None:
        """Copy (scaled) this bucket's gradients into it; adopt its views as ``.grad``."""
        # A backward with create_graph=True runs the hooks with grad mode on and hands
        # gradients that require grad; the reduction is not part of any graph (torch
        # DDP's reducer, in C++, records none either), and out= ops refuse autograd.
        with torch.no_grad():
            if self.buckets[b].sparse:
                self._fill_sparse(b, scale)
            else:
                self._fill_buckets(b, scale)

    def _fill_sparse(self, b: int, scale: bool) -> None:
        """The bucket's buffer becomes its parameter's (scaled) sparse gradient."""
        bucket = self.buckets[b]
        (name,), (p,) = bucket.names, bucket.params
        wire = bucket.buffer.dtype
        g = p.grad
        if g is None:
            bucket.buffer = empty_sparse_like(p, wire)  # reduced as nothing, so no rank hangs
            return
        if not g.is_sparse:
            raise DataParallelError(
                f"parameter '{name}' belongs to an nn.Embedding/EmbeddingBag with sparse=True, "
                f"so DataParallel reduces its gradient as a sparse tensor, but it got a "
                f"{g.layout} gradient (a dense use of the same weight, such as tied weights, "
                "makes it dense). Fix: build the module with sparse=False, or keep the weight's "
                "uses sparse. torch DDP refuses the same."
            )
        g = g.to(wire)
        # Without scaling the buffer is the gradient itself, as DDP hands its hooks.
        bucket.buffer = torch.div(g, self._divide_by()) if scale else g

    def _fill_buckets(self, b: int, scale: bool) -> None:
        bucket = self.buckets[b]
        present = []
        for v, p, name in zip(bucket.views, bucket.params, bucket.names):
            g = p.grad
            if g is not None and g.is_sparse:
                raise DataParallelError(
                    f"parameter '{name}' got a sparse gradient, but DataParallel "
                    "reduces it in a dense bucket: only the weights of nn.Embedding and "
                    "nn.EmbeddingBag modules built with sparse=True are reduced as sparse (the "
                    "rule torch DDP uses). Fix: produce it from such a module, or make the "
                    "gradient dense."
                )
            if g is None:
                v.zero_()  # its share of the bucket is reduced as zeros
            else:
                present.append((v, p, g))
        if scale:
            # One pass per gradient: scale straight into the bucket (copy-then-divide
            # reads and writes the bucket twice; docs/benchmarks.md, "Where the time goes").
            # A true divide, not a multiply by 1/world: it rounds as torch DDP does.
            world = self._divide_by()
            for v, _, g in present:
                torch.div(g, world, out=v)
        elif present:
            torch._foreach_copy_([v for v, _, _ in present], [g for _, _, g in present])
        if self.adopt[b]:
            # See [Note: adopting bucket views]; ``g is v`` when adopted in an
            # earlier step and accumulated into in place since.
            for v, p, g in present:
                if g is not v and not g.requires_grad:
                    p.grad = v

    def _divide_by(self) -> int:
        return self.divisor() if self.divisor is not None else self.comm.world_size

    def _launch_used_map(self) -> None:
        w = self.window
        assert w is not None
        used = torch.zeros(
            len(self.params), dtype=torch.int32, device=self.buckets[0].buffer.device
        )
        for i, (_, p) in enumerate(self.params):
            if p.grad is not None:
                used[i] = 1
        w.used_map = used
        w.used_map_work = self.comm.all_reduce(used, async_op=True)

    def end_backward(self) -> None:
        """End-of-backward callback (queued from the graph task that armed the window)."""
        w = self.window
        if w is None or not w.sync or self._computed_no_parameter_gradient(w):
            # A non-syncing backward is over: the next one re-reads the flags.
            self.window = None
            return
        w.ended = True
        if self.manual:
            if self.hold_only_while_busy and not w.learning:
                self._launch_ready()  # the wire may have gone idle since the last hook
            last = len(self.buckets) - 1
            if (
                self.buckets[last].delayed
                and not self.held  # held, the delayed bucket waits for finalize too
                and w.next_bucket == last
                and w.pending[last] <= 0
                and not w.learning
            ):
                # The delayed bucket's time is the end of backward, in manual mode too.
                self._launch(last)
                w.next_bucket += 1
                if self.find_unused and w.used_map_work is None:
                    self._launch_used_map()
            self.grad_guard.poison(self.params)
            return
        try:
            self.finalize(blocking=True, end_of_backward=True)
        except BaseException as exc:
            self.failure = exc
            raise

    def _computed_no_parameter_gradient(self, w: _Window) -> bool:
        """The backward ran through the wrapper's outputs but reached no parameter.

        [Note: backwards that compute no parameter gradient]
        ``torch.autograd.grad(out, x)`` with respect to inputs (the first half of a
        gradient penalty), or ``backward(inputs=[x])``, runs the sink but no
        parameter's gradient accumulator, so no hook fires. torch DDP reduces nothing
        then (its reducer is driven by those hooks alone) and reduces the backward
        that does reach the parameters, such as the penalty's. The window is dropped
        the same way here, which is safe because it issued no collective (every rank
        that runs the same code drops it too). Not when the wrapped parameters were
        replaced or changed behind the wrapper (``explain`` names what happened):
        then the gradients went to other tensors, and finalize raises saying so. A
        backward that reached some parameters but not all still raises at finalize.
        """
        if w.counts or w.next_bucket or w.used_map_work is not None or w.deferred:
            return False
        return not self.explain([name for name, _ in self.params])

    def begin_split_part(self, part: str) -> None:
        """Enter a part of a split backward (see [Note: split backward parts])."""
        if part == "weight":
            self.check_can_start("the weight part of a split backward")
            self.split_part = part
            # Armed outside backward, so no end-of-backward callback is queued: the
            # window spans every autograd call of the part and ends in end_split_part.
            self.begin_backward(self.last_token)
        else:
            self.split_part = part

    def end_split_part(self) -> None:
        part, self.split_part = self.split_part, None
        if part == "weight":
            self.end_backward()

    # -- finalization ---------------------------------------------------------

    def finalize(self, *, blocking: bool, end_of_backward: bool = False) -> ReductionHandle | None:
        """The one wait-and-write-back path, for the automatic callback and the caller.

        ``end_of_backward``: called by the end-of-backward callback, where the
        backward is over even though the graph task id is still set.
        """
        in_bwd = _autograd.in_backward() and not end_of_backward
        if self.handle is not None and not self.handle.done:
            raise DataParallelError(
                "finalize_backward() called again before the previous handle was waited: "
                "wait on the previous handle (handle.wait()) first."
            )
        w = self.window
        if w is not None and w.sync:
            unlaunched = w.next_bucket < len(self.buckets) - self.held or any(
                n > 0
                for n in w.pending[w.next_bucket :]  # a held bucket still owes
            )
            if in_bwd and (w.learning or unlaunched):
                raise DataParallelError(
                    f"finalize_backward() was called inside backward, but only {w.next_bucket} "
                    f"of {len(self.buckets)} buckets have launched. Finalize from a hook that "
                    "runs after every wrapped parameter's gradient is ready, or after "
                    "backward returns."
                )
        elif self.accumulating and self.require_sync and not in_bwd:
            # Deferred reduction: pay the owed all-reduce of the accumulated grads now.
            w = _Window(sync=True, deferred=True)
            w.pending = [0] * len(self.buckets)
            w.works = [None] * len(self.buckets)
            self.window = w
        else:
            return None
        self.grad_guard.restore()  # launching the remaining buckets reads the local grads
        missing = self._flush()
        handle = ReductionHandle(
            self._bucket_works(w, missing)
            + ([w.used_map_work] if w.used_map_work is not None else []),
            on_complete=lambda: self._complete(w, missing),
            label="DataParallel gradients",
        )
        if blocking:
            with phase("dp.finalize_wait"):
                handle.wait()
            return None
        self.grad_guard.poison(self.params)  # until handle.wait() writes them
        self.handle = handle
        return handle

    def _flush(self) -> list[str]:
        """Launch every bucket not yet launched, in order; return params that never got a grad."""
        w = self.window
        assert w is not None
        missing: list[str] = []
        if w.learning:
            self.expected_counts = {i: w.counts.get(i, 0) for i in range(len(self.params))}
        elif not self.find_unused and not w.deferred:
            expected = self.expected_counts or {}
            for i, (name, _) in enumerate(self.params):
                if w.counts.get(i, 0) < expected.get(i, 1):
                    missing.append(name)
        while w.next_bucket < len(self.buckets):
            self._launch(w.next_bucket)
            w.next_bucket += 1
        # static_graph learns, once, which parameters no rank uses (see _complete).
        if (self.find_unused or w.learning) and w.used_map_work is None:
            self._launch_used_map()
        return missing

    def _bucket_works(self, w: _Window, missing: list[str]) -> list[CommWork]:
        """The handle's works; each also writes back and reports its bucket when stepping.

        [Note: stepping buckets as they complete]
        With ``on_bucket_reduced`` set (``DataParallel.overlap_optimizer``), waiting
        bucket b's all-reduce is followed at once by its write-back and the report,
        which steps its parameters, before bucket b+1 is waited: the step of b runs on
        the waiting thread while b+1.. are still reducing. Not per bucket, but after
        every bucket, with ``find_unused_parameters`` (which parameters no rank used is
        known only from the used map, reduced last); never when a parameter got no
        gradient (the finalize raises, and nothing is stepped).
        """
        works = [x for x in w.works if x is not None]
        if self.on_bucket_reduced is None or missing or self.find_unused:
            return works
        return [
            CommWork(x, after=functools.partial(self._bucket_reduced, w, b))
            for b, x in enumerate(w.works)
            if x is not None
        ]

    def _bucket_reduced(self, w: _Window, b: int) -> None:
        bucket = self.buckets[b]
        self.grad_guard.restore(bucket.params)
        self._write_back(bucket, set())
        w.written.add(b)
        if self.on_bucket_reduced is not None:
            self.on_bucket_reduced(b)

    def _write_back(self, bucket: Bucket, globally_unused: set[int]) -> None:
        if bucket.sparse:  # see [Note: sparse buckets] in _buckets.py
            (i,), (p,) = bucket.param_indices, bucket.params
            if i not in globally_unused:
                p.grad = bucket.buffer.to(p.dtype)
            return
        if self.bucket_view:  # with bucket views .grad is the view: nothing to copy
            for i, p, view in zip(bucket.param_indices, bucket.params, bucket.views):
                if p.grad is None and i not in globally_unused:
                    p.grad = view
            return
        dst, src = [], []
        for i, p, view in zip(bucket.param_indices, bucket.params, bucket.views):
            if i in globally_unused:
                continue  # as torch DDP: a param no rank used keeps its .grad
            if p.grad is None:
                p.grad = view.to(p.dtype).clone()
            elif p.grad is view:
                continue  # adopted at launch: the reduced values are already there
            else:
                dst.append(p.grad)
                src.append(view)
        if dst:
            with torch.no_grad():  # .grad of a create_graph backward requires grad
                torch._foreach_copy_(dst, src)  # one fused write-back per bucket

    def _complete(self, w: _Window, missing: list[str]) -> None:
        self.grad_guard.restore()
        globally_unused = set(self.static_unused)
        if w.used_map is not None:
            self.last_used_map = w.used_map
            globally_unused = {i for i, n in enumerate(w.used_map.tolist()) if n == 0}
            if w.learning:
                # As torch DDP's static graph: a parameter no rank used in the first
                # iteration keeps its .grad (None after zero_grad) in every later one,
                # where no used map is reduced; one used on some rank gets the average.
                self.static_unused = frozenset(globally_unused)
        for bucket in self.buckets:
            if bucket.index not in w.written:
                self._write_back(bucket, globally_unused)
        self.window = None
        self.accumulating = False
        if self.on_bucket_reduced is not None and not missing and not w.written:
            for b in range(len(self.buckets)):  # find_unused_parameters: after the used map
                self.on_bucket_reduced(b)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            why = self.explain(missing)
            raise DataParallelError(
                f"{len(missing)} parameter(s) received no gradient in a synced backward: "
                f"{shown}. Their buckets were reduced with zeros so that no rank hangs. "
                + (
                    why
                    or "If some parameters are legitimately unused, pass "
                    "DataParallel(find_unused_parameters=True)."
                )
            )

    def reset(self) -> None:
        self.grad_guard.restore()
        self.split_part = None
        self.window = None
        self.accumulating = False
        self.handle = None
        self.failure = None
