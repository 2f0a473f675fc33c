"""The training loop: one step function for every layout, and the loss for logging.

[Note: the logged loss]
Each data-parallel replica trains on its slice of the step's global batch, so the
step's loss is the mean over replicas of each replica's mean loss, which equals the
mean loss over the global batch (the slices are equal). In a pipeline only the
rank holding the last stage computes the loss: it is broadcast over the pp group
first, then averaged over the replicas. Every rank ends with the same value.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch

from cadence._grad_timing.timing import GradientTiming
from cadence._groups.missing import missing_ranks
from cadence.comm import Comm, EventLog
from cadence.errors import CadenceError
from cadence.train._errors import CollectiveTimeoutError
from cadence.train.build import TrainState, loss_fn

__all__ = [
    "DEFAULT_EVAL_BATCHES",
    "CollectiveTimeoutError",
    "LoopResult",
    "evaluate",
    "run_loop",
    "train_step",
]

# Batches per evaluation when --eval-batches is not given: enough rows that the
# held-out loss moves less between evaluations than the curve it tracks.
DEFAULT_EVAL_BATCHES = 4


@dataclass
class LoopResult:
    """What a run measured on this rank."""

    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)

    @property
    def step_time_median_s(self) -> float:
        return statistics.median(self.step_times) if self.step_times else float("nan")


class _LossReducer:
    """See [Note: the logged loss]."""

    def __init__(self, state: TrainState) -> None:
        pg, layout = state.groups, state.layout
        # Its own log: the wrappers' log measures gradient reductions only, but a
        # timeout report must name these collectives too.
        self.log = EventLog(capacity=8)
        self.pp = Comm(pg.pp, name="pp-loss", event_log=self.log) if layout.pp > 1 else None
        self.dp = Comm(pg.dp, name="dp-loss", event_log=self.log) if layout.dp > 1 else None
        self.owner = 0
        if state.runtime is not None:
            self.owner = state.runtime.placement[state.runtime.num_stages - 1]

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        if self.pp is not None:
            self.pp.broadcast(local, src=self.owner)
        if self.dp is not None:
            self.dp.all_reduce(local, op="avg")
        return local


def train_step(
    state: TrainState,
    x: torch.Tensor,
    y: torch.Tensor,
    reduce_loss: Callable[[torch.Tensor], torch.Tensor],
) -> float:
    """One optimizer step on this rank's rows ``x``, ``y``; returns the logged loss.

    The step advances ``state.step``. With ``--finalize manual`` (pp=1) the gradient
    reductions stay in flight while the loss is averaged, and are waited only
    before the optimizer reads the gradients.
    """
    if state.runtime is not None:
        losses: list[torch.Tensor] = []
        state.runtime.step(x, target=y, losses=losses)
        # Only the last stage's rank has losses; the others get theirs by broadcast.
        local = state.runtime.policy.combine(losses).reshape(1) if losses else torch.zeros(1)
        _update(state)
        loss = reduce_loss(local)
    else:
        model = state.model
        assert model is not None
        # pp=1: build always wraps the model (DataParallel or fully_shard).
        timing = cast(GradientTiming, model)
        out = loss_fn(model(x), y)
        out.backward()
        metric = out.detach().reshape(1)
        if timing.require_manual_backward_finalization:
            handle = timing.finalize_backward(async_op=True)
            loss = reduce_loss(metric)
            if handle is not None:
                handle.wait()
            _update(state)
        else:
            _update(state)
            loss = reduce_loss(metric)
    state.step += 1
    return float(loss)


def _update(state: TrainState) -> None:
    """The update of reduced gradients: clip (``--clip-grad-norm``), the optimizer step,
    the learning-rate schedule's step, and the gradients dropped."""
    if state.clipper is not None:
        state.clipper()
    state.optimizer.step()
    if state.scheduler is not None:
        state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)


def evaluate(
    state: TrainState,
    batch_size: int,
    batches: int,
    reduce_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """The mean loss of the model on ``batches`` held-out batches of ``--data``, the
    same value on every rank; no gradient, no optimizer step, no change to the data
    position. Collective: every rank calls it at the same step."""
    data = state.data
    if not hasattr(data, "val_batch"):
        raise CadenceError("evaluate needs --data: the Markov task has no held-out tokens")
    rows = state.groups.local_slice(batch_size)
    reduce_loss = reduce_loss or _LossReducer(state)
    total = torch.zeros(1)
    with torch.no_grad():
        for j in range(batches):
            x, y = data.val_batch(j, batch_size)
            x, y = x[rows], y[rows]
            if state.runtime is not None:
                losses: list[torch.Tensor] = []
                state.runtime.eval(x, target=y, losses=losses)
                if losses:  # the last stage's rank; the others learn it by broadcast
                    total += state.runtime.policy.combine(losses).reshape(1).float()
            else:
                assert state.model is not None
                total += loss_fn(state.model(x), y).reshape(1)
    # One reduction for all batches: the mean of the replicas' means is the mean over
    # the global rows, as for the training loss (see [Note: the logged loss]).
    return float(reduce_loss(total / batches))


def run_loop(
    state: TrainState,
    steps: int,
    batch_size: int,
    on_step: Callable[[int, float], None] | None = None,
    *,
    eval_every: int = 0,
    eval_batches: int = 0,
    on_eval: Callable[[int, float], None] | None = None,
) -> LoopResult:
    """Run ``steps`` steps from ``state.step``; ``on_step(step, loss)`` after each.

    Step ``i`` trains on global batch ``i`` of the data stream, sliced to this
    rank's data-parallel replica (`ParallelGroups.local_slice`), so the run is the
    same whatever the layout. With ``eval_every`` K, after every K-th step (counted
    from 1) and after the last, ``on_eval(step, loss)`` gets `evaluate`'s loss over
    ``eval_batches`` batches (0: `DEFAULT_EVAL_BATCHES`), before that step's
    ``on_step``; ``step`` is 0-based, as for ``on_step``. Evaluations are not in the
    step times.
    """
    rows = state.groups.local_slice(batch_size)
    reduce_loss = _LossReducer(state)
    result = LoopResult()
    last = state.step + steps
    for _ in range(steps):
        step = state.step
        t0 = time.perf_counter()
        x, y = state.data.batch(step, batch_size)
        state.event_log.mark("step", step=step + 1)
        try:
            loss = train_step(state, x[rows], y[rows], reduce_loss)
        except RuntimeError as exc:  # torch's DistBackendError is a RuntimeError
            if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
                raise
            raise CollectiveTimeoutError(
                _describe_timeout(state, step + 1, _logs(state, reduce_loss), exc)
            ) from exc
        state.event_log.mark("step_end", step=step + 1)
        result.step_times.append(time.perf_counter() - t0)
        result.losses.append(loss)
        # Before on_step, which may checkpoint: the checkpoint of a step then holds
        # that step's evaluation, and a resumed run's history matches an unbroken one.
        if eval_every and ((step + 1) % eval_every == 0 or step + 1 == last):
            held_out = evaluate(
                state, batch_size, eval_batches or DEFAULT_EVAL_BATCHES, reduce_loss
            )
            if on_eval is not None:
                on_eval(step, held_out)
        if on_step is not None:
            on_step(step, loss)
    return result


def _logs(state: TrainState, reduce_loss: _LossReducer) -> tuple[EventLog, ...]:
    """Every log a step's collectives are recorded in."""
    clip = (state.clipper.log,) if state.clipper is not None else ()
    return (state.event_log, reduce_loss.log, *clip)


_GRACE_S = 2.0  # how long a timed-out rank waits for the others to report theirs


def _describe_timeout(
    state: TrainState, step: int, logs: tuple[EventLog, ...], exc: BaseException
) -> str:
    """Name this rank, the step and the collective that was still waiting for its peers."""
    # Blocked in wait(): started waiting, never finished. (Events of synchronous
    # object collectives carry no wait times at all.)
    waiting = [
        e
        for log in logs
        for e in log.collectives()
        if e.wait_start_t is not None and e.wait_end_t is None
    ]
    if waiting:
        e = max(waiting, key=lambda e: e.wait_start_t or 0.0)
        what = f"{e.kind} on group {e.group!r} ({e.numel} x {e.dtype})"
    else:
        what = "a pipeline send/recv or a collective outside the event log"
    # Which peer: [Note: naming the rank that stopped answering] in _groups/missing.py.
    missing = missing_ranks(step, grace_s=_GRACE_S)
    who = f" {missing.describe(_GRACE_S)}." if missing is not None else ""
    return (
        f"rank {state.groups.rank} timed out in step {step} waiting for its peers in {what}: "
        f"a peer rank stopped answering (hung, or stopped).{who} Raise --collective-timeout "
        f"if the peers are only slow. Backend error: {str(exc).splitlines()[0]}"
    )
