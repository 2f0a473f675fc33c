"""Scenarios for collective counts, accumulation, unused parameters, reentrant
checkpointing, buffers, wire dtypes and comm hooks; the world-2 launch runs `SCENARIOS`."""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cadence
from cadence.data_parallel import WindowState
from cadence.testing import max_abs_diff, named_grads
from tests._scenarios import assert_raises, cases, scenarios
from tests.data_parallel.common import (
    WIDTH,
    RankDependent,
    TwoHeads,
    global_batch,
    local,
    make_mlp,
    strip,
)


def _counting() -> tuple[cadence.DataParallel, cadence.EventLog, Any]:
    """Four buckets (one per hidden layer's weight and bias; packed from the last
    layer, the small head shares the last hidden layer's), an event log, and one
    backward on this rank's batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    log = cadence.EventLog()
    dp = cadence.DataParallel(
        make_mlp(), bucket_cap_mb=0.001, first_bucket_cap_mb=None, event_log=log
    )
    x, y = global_batch(0, world)
    xl, yl = local(x, rank, world), local(y, rank, world)

    def step() -> None:
        F.mse_loss(dp(xl), yl).backward()

    return dp, log, step


def _after_auto_and_manual_steps() -> tuple[cadence.DataParallel, cadence.EventLog, Any]:
    """The wrapper after one auto step, then one manual step finalized (and checked)."""
    dp, log, step = _counting()
    step()
    dp.require_manual_backward_finalization = True
    step()
    dp.finalize_backward()
    log.clear()
    return dp, log, step


def _same_on_every_rank(value: Any, what: str) -> None:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    assert all(v == everyone[0] for v in everyone), f"{what} differs across ranks: {everyone}"


def synced_step_issues_one_all_reduce_per_bucket() -> None:
    dp, log, step = _counting()
    assert dp.num_buckets == 4, f"{dp.num_buckets} buckets"
    log.clear()
    step()
    assert log.count("all_reduce") == dp.num_buckets, log.counts()


def manual_mode_launches_in_backward_and_matches_auto_order() -> None:
    dp, log, step = _counting()
    log.clear()
    step()
    auto_sig = log.signature()
    dp.require_manual_backward_finalization = True
    log.clear()
    step()
    # Launched during backward, before finalize; finalize adds none.
    assert log.count("all_reduce") == dp.num_buckets, f"before finalize: {log.counts()}"
    dp.finalize_backward()
    assert log.count("all_reduce") == dp.num_buckets, f"after finalize: {log.counts()}"
    assert log.signature() == auto_sig, (log.signature(), auto_sig)
    # The same collectives in the same order on every rank.
    _same_on_every_rank(auto_sig, "the auto step's signature")


def finalize_with_nothing_pending_is_a_noop() -> None:
    dp, log, _ = _after_auto_and_manual_steps()
    got = dp.finalize_backward()
    assert got is None, f"returned {got!r}"
    assert log.count() == 0, log.counts()


def accumulation_reduces_exactly_once() -> None:
    dp, log, step = _after_auto_and_manual_steps()
    dp.finalize_backward()  # nothing pending
    # K=3 accumulation with no_sync, then a synced backward.
    dp.require_manual_backward_finalization = False
    log.clear()
    with dp.no_sync():
        step()
        step()
    assert log.count("all_reduce") == 0, f"inside no_sync: {log.counts()}"
    step()
    assert log.count("all_reduce") == dp.num_buckets, f"synced step: {log.counts()}"
    # Deferred: accumulate with the setter, then finalize with sync on.
    log.clear()
    dp.set_requires_gradient_sync(False)
    step()
    step()
    assert log.count("all_reduce") == 0, f"sync off: {log.counts()}"
    dp.set_requires_gradient_sync(True)
    dp.finalize_backward()
    assert log.count("all_reduce") == dp.num_buckets, f"deferred finalize: {log.counts()}"


def find_unused_adds_one_used_map_all_reduce() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, world)
    unused = cadence.DataParallel(
        TwoHeads(), find_unused_parameters=True, event_log=cadence.EventLog()
    )
    unused.event_log.clear()
    F.mse_loss(unused(local(x, rank, world)), local(y, rank, world)).backward()
    count = unused.event_log.count("all_reduce")
    assert count == unused.num_buckets + 1, f"{count} all-reduces, {unused.num_buckets} buckets"
    assert unused.module.b.weight.grad is None, (
        "a globally unused parameter must keep .grad=None (as DDP)"
    )


def unused_on_one_rank_matches_ddp_and_launch_order() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, world)
    xl, yl = local(x, rank, world), local(y, rank, world)
    m = RankDependent()
    dp = cadence.DataParallel(copy.deepcopy(m), find_unused_parameters=True)
    ddp = DDP(copy.deepcopy(m), find_unused_parameters=True)
    F.mse_loss(dp(xl), yl).backward()
    F.mse_loss(ddp(xl), yl).backward()
    diff = max_abs_diff(strip(named_grads(dp)), strip(named_grads(ddp)))
    assert diff < 1e-7, f"grads differ from DDP by {diff:.3e}"
    # Used on rank 0, so every rank (rank 1 too) gets the average.
    assert dp.module.b.weight.grad is not None, "b.weight.grad is None"
    _same_on_every_rank(dp.event_log.signature(), "the signature")


# ---------------------------------------------------------------------------
# Accumulation
# ---------------------------------------------------------------------------


def accumulation_matches_reference(kind: str) -> None:
    """K=4 microbatches accumulated, one reduction; compare to the reference on all of them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_mlp()
    ref = copy.deepcopy(model)
    dp = cadence.DataParallel(copy.deepcopy(model), bucket_cap_mb=0.002)
    k = 4
    batches = [global_batch(i, world) for i in range(k)]

    def micro(i: int) -> torch.Tensor:
        x, y = batches[i]
        return F.mse_loss(dp(local(x, rank, world)), local(y, rank, world)) / k

    if kind == "no_sync":
        with dp.no_sync():
            for i in range(k - 1):
                micro(i).backward()
        micro(k - 1).backward()
    elif kind == "setter":
        dp.set_requires_gradient_sync(False)
        for i in range(k - 1):
            micro(i).backward()
        dp.set_requires_gradient_sync(True)
        micro(k - 1).backward()
    elif kind == "deferred":
        dp.set_requires_gradient_sync(False)
        for i in range(k):
            micro(i).backward()
        dp.set_requires_gradient_sync(True)
        assert dp.state is WindowState.ACCUMULATING
        dp.finalize_backward()
    elif kind == "interleaved":
        # 1F1B-like: all forwards outstanding, backwards FIFO, setter flipped before the last.
        losses = [micro(i) for i in range(k)]
        dp.set_requires_gradient_sync(False)
        for i in range(k - 1):
            losses[i].backward()
        dp.set_requires_gradient_sync(True)
        losses[k - 1].backward()
    elif kind == "fwd_outside_bwd_inside":
        loss = micro(0)
        log = dp.event_log
        log.clear()
        with dp.no_sync():
            loss.backward()
        assert log.count("all_reduce") == 0, "a backward inside no_sync reduced"
        for i in range(1, k):
            micro(i).backward()
    else:
        raise ValueError(kind)
    for i in range(k):
        x, y = batches[i]
        (F.mse_loss(ref(x), y) / k).backward()
    diff = max_abs_diff(strip(named_grads(dp)), named_grads(ref))
    assert diff < 1e-6, f"grads differ from the reference by {diff:.3e}"


class _Twice(nn.Module):
    """One layer used twice under reentrant checkpointing: its hook fires twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        h = checkpoint(self.shared, h, use_reentrant=True)
        h = checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        return self.out(h)


def static_graph_handles_a_layer_checkpointed_twice() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _Twice()
    ref = copy.deepcopy(model)
    static = cadence.DataParallel(copy.deepcopy(model), static_graph=True, bucket_cap_mb=0.001)
    # Step 0 learns the hook counts (no overlap); step 1 uses them.
    for step in range(2):
        x, y = global_batch(step, world)
        for p in static.parameters():
            p.grad = None
        ref.zero_grad()
        F.mse_loss(static(local(x, rank, world).requires_grad_()), local(y, rank, world)).backward()
        F.mse_loss(ref(x), y).backward()
        diff = max_abs_diff(strip(named_grads(static)), named_grads(ref))
        assert diff < 1e-6, f"step {step}: grads differ from the reference by {diff:.3e}"


def hook_firing_twice_names_the_parameter() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    plain = cadence.DataParallel(_Twice(), bucket_cap_mb=0.001)
    x, y = global_batch(0, world)
    assert_raises(
        lambda: F.mse_loss(
            plain(local(x, rank, world).requires_grad_()), local(y, rank, world)
        ).backward(),
        "'shared.",
        "static_graph=True",
    )


def reentrant_checkpointed_head_finalizes_after_outer_backward() -> None:
    """A reentrant-checkpointed *last* layer runs its backward in a nested graph task: the
    window must still finalize at the end of the outer backward, not of the nested one."""
    from torch.utils.checkpoint import checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, world)

    class CkptHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.body = make_mlp(depth=2)
            self.head = nn.Linear(1, 1)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.head, self.body(t), use_reentrant=True)

    m = CkptHead()
    ref2 = copy.deepcopy(m)
    dp = cadence.DataParallel(copy.deepcopy(m), bucket_cap_mb=0.001)
    F.mse_loss(dp(local(x, rank, world)), local(y, rank, world)).backward()
    F.mse_loss(ref2(x), y).backward()
    diff = max_abs_diff(strip(named_grads(dp)), named_grads(ref2))
    assert diff < 1e-6, f"grads differ from the reference by {diff:.3e}"
    assert dp.state.value == "idle", f"state {dp.state.value} after backward"


def parameters_and_buffers_broadcast_from_rank0() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # every rank initialises differently
    m = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, 1))
    dp = cadence.DataParallel(m)
    params = torch.cat([p.detach().reshape(-1) for p in dp.parameters()])
    gathered = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    init_diff = max(float((g - gathered[0]).abs().max()) for g in gathered)
    # Make the running stats diverge, then a forward broadcasts rank 0's.
    with torch.no_grad():
        dp.module[1].running_mean.fill_(float(rank + 1))
    x, _ = global_batch(0, world)
    dp.module.eval()  # so this forward does not update the stats after the broadcast
    dp(local(x, rank, world)).sum().backward()
    rm = dp.module[1].running_mean.clone()
    got = [torch.empty_like(rm) for _ in range(world)]
    dist.all_gather(got, rm)
    assert init_diff == 0.0, f"parameters differ across ranks after init by {init_diff}"
    buffer_diff = max(float((g - got[0]).abs().max()) for g in got)
    assert buffer_diff == 0.0, f"running_mean differs across ranks by {buffer_diff}"


# name -> (DataParallel kwargs, comm hook, bounds on the gradient difference or None).
WIRES: dict[str, tuple[dict[str, Any], Any, tuple[float, float] | None]] = {
    "reduce_dtype_bf16": ({"reduce_dtype": torch.bfloat16}, None, (0, 1e-2)),  # bf16 rounding
    "bf16_hook": ({}, cadence.data_parallel.comm_hooks.bf16_compress_hook, None),
    "fp16_hook": ({}, cadence.data_parallel.comm_hooks.fp16_compress_hook, (0, 1e-3)),
    "allreduce_hook": ({}, cadence.data_parallel.comm_hooks.allreduce_hook, (-1, 1e-6)),
}


def _one_step(model: nn.Module, dp: cadence.DataParallel) -> tuple[dict[str, Any], dict[str, Any]]:
    """(dp's grads, the reference's) after one step on the world batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = copy.deepcopy(model)
    x, y = global_batch(0, world)
    F.mse_loss(ref(x), y).backward()
    F.mse_loss(dp(local(x, rank, world)), local(y, rank, world)).backward()
    return strip(named_grads(dp)), named_grads(ref)


def wire_dtype_or_comm_hook(wire: str) -> None:
    """.grad stays fp32, the reduction is counted through cadence.Comm, values close."""
    kw, hook, bounds = WIRES[wire]
    model = make_mlp()
    dp = cadence.DataParallel(copy.deepcopy(model), **kw)
    if hook is not None:
        dp.register_comm_hook(None, hook)
    g, gref = _one_step(model, dp)
    dtypes = {str(v.dtype) for v in g.values()}
    assert dtypes == {"torch.float32"}, f".grad dtypes {dtypes}"
    count = dp.event_log.count("all_reduce")
    assert count == 1, f"{count} all-reduces counted"
    if bounds is not None:
        diff = max_abs_diff(g, gref)
        assert bounds[0] < diff < bounds[1], f"diff {diff:.3e} outside {bounds}"


def torch_ddp_comm_hook_runs_unchanged() -> None:
    """A torch DDP hook works unchanged (Future-returning, gets un-divided buckets)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = make_mlp()
    dp = cadence.DataParallel(copy.deepcopy(model))
    dp.register_comm_hook(None, default_hooks.allreduce_hook)
    g, gref = _one_step(model, dp)
    diff = max_abs_diff(g, gref)
    assert diff < 1e-6, f"grads differ from the reference by {diff:.3e}"


def _model_batch_and_reference() -> tuple[nn.Module, torch.Tensor, torch.Tensor, nn.Module]:
    """The held-bucket scenarios' model, this rank's batch, and a copy of the model
    after one single-process backward on the world batch (the reference)."""
    model = make_mlp()
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, world)
    ref = copy.deepcopy(model)
    F.mse_loss(ref(x), y).backward()
    return model, local(x, rank, world), local(y, rank, world), ref


def held_buckets_launch_at_finalize_after_the_callers_collective() -> None:
    """hold_last_buckets(2): backward launches all but the last two; a collective the
    caller issues in between goes first; finalize launches the two; the gradients are
    the unheld run's, bit for bit, and the reference's."""
    model, xl, yl, ref = _model_batch_and_reference()
    runs = {}
    for held in (0, 2):
        log = cadence.EventLog()
        dp = cadence.DataParallel(
            copy.deepcopy(model), bucket_cap_mb=0.001, first_bucket_cap_mb=None, event_log=log
        )
        dp.require_manual_backward_finalization = True
        dp.hold_last_buckets(held)
        assert dp.held_buckets == held
        F.mse_loss(dp(xl), yl).backward()
        assert log.count("all_reduce") == dp.num_buckets - held, (held, log.counts())
        caller = cadence.Comm(dist.group.WORLD, name="caller", event_log=log)
        caller.all_reduce(torch.ones(7))  # the caller's own collective
        dp.finalize_backward()
        runs[held] = (strip(named_grads(dp)), [e.numel for e in log.collectives("all_reduce")])
    (g0, sig0), (g2, sig2) = runs[0], runs[2]
    buckets = sig0[:-1]  # unheld: every bucket in backward, then the caller's 7
    assert sig0[-1] == 7 and len(buckets) == 4, sig0
    assert sig2 == [*buckets[:-2], 7, *buckets[-2:]], (sig2, sig0)
    assert all(torch.equal(g0[k], g2[k]) for k in g0), "held buckets changed the gradients"
    diff = max_abs_diff(g2, named_grads(ref))
    assert diff < 1e-6, f"grads differ from the reference by {diff:.3e}"
    _same_on_every_rank(sig2, "the held step's signature")


def hold_every_bucket_leaves_backward_silent() -> None:
    dp, log, step = _counting()
    dp.require_manual_backward_finalization = True
    dp.hold_last_buckets(dp.num_buckets)
    log.clear()
    step()
    assert log.count("all_reduce") == 0, f"backward launched {log.counts()}"
    handle = dp.finalize_backward(async_op=True)
    assert log.count("all_reduce") == dp.num_buckets, log.counts()
    handle.wait()
    assert dp.state is WindowState.IDLE, dp.state


def hold_last_buckets_misuse_is_refused() -> None:
    dp, _, step = _counting()
    n = dp.num_buckets
    assert_raises(lambda: dp.hold_last_buckets(1), "automatic", "require_manual_backward")
    dp.require_manual_backward_finalization = True
    for bad in (-1, n + 1, True, 1.0):
        assert_raises(lambda bad=bad: dp.hold_last_buckets(bad), "0 to num_buckets", repr(bad))
    dp.hold_last_buckets(1)
    step()
    assert_raises(lambda: dp.hold_last_buckets(0), "pending", "finalize_backward()")
    dp.finalize_backward()
    assert_raises(
        lambda: setattr(dp, "require_manual_backward_finalization", False),
        "held",
        "hold_last_buckets(0)",
    )
    clone = copy.deepcopy(dp)  # the flag travels with a copy, after the manual one
    assert clone.held_buckets == 1 and clone.require_manual_backward_finalization
    assert not clone.holds_only_while_busy
    assert_raises(
        lambda: dp.hold_last_buckets(1, only_while_busy=1), "True or False", "only_while_busy"
    )
    dp.hold_last_buckets(1, only_while_busy=True)
    clone = copy.deepcopy(dp)
    assert clone.held_buckets == 1 and clone.holds_only_while_busy
    dp.held_buckets = 2  # the count changes, the mode stays
    assert dp.holds_only_while_busy
    dp.hold_last_buckets(0)
    dp.require_manual_backward_finalization = False
    assert dp.held_buckets == 0 and not dp.holds_only_while_busy


def _wire(state: dict[str, Any], bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """A comm hook on a wire the test controls: the values travel at once (a blocking
    all-reduce), and the future says when they land: at once while
    ``state["delivers"]``, else when `_deliver` completes it. Records each launch with
    how many gradients had accumulated by then."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    dist.all_reduce(buf)
    state["launched"][bucket.index()] = state["accumulated"]
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if state["delivers"]:
        fut.set_result(buf)
    else:
        state["pending"].append((fut, buf))
    return fut


def _deliver(state: dict[str, Any]) -> None:
    """Every launched bucket lands; those launched from now on land at once."""
    state["delivers"] = True
    for fut, buf in state["pending"]:
        if not fut.done():
            fut.set_result(buf)


def held_buckets_wait_only_while_busy() -> None:
    """hold_last_buckets(2, only_while_busy=True) with a comm hook whose futures the
    test completes: on a wire that keeps up (each future completes at once) the held
    buckets find every launched one landed and launch in backward; on one that has
    not delivered (the futures stay pending) they wait, as a plain hold; finalize
    launches what is held, in bucket order; the gradients are the reference's."""
    model, xl, yl, ref = _model_batch_and_reference()
    for keeps_up in (True, False):
        state: dict[str, Any] = {
            "delivers": keeps_up, "launched": {}, "pending": [], "accumulated": 0
        }  # fmt: skip
        dp = cadence.DataParallel(
            copy.deepcopy(model), bucket_cap_mb=0.001, first_bucket_cap_mb=None
        )
        dp.register_comm_hook(state, _wire)
        dp.require_manual_backward_finalization = True
        dp.hold_last_buckets(2, only_while_busy=True)
        assert dp.held_buckets == 2 and dp.holds_only_while_busy
        F.mse_loss(dp(xl), yl).backward()
        expected = dp.num_buckets if keeps_up else dp.num_buckets - 2
        assert len(state["launched"]) == expected, (keeps_up, state["launched"])
        _deliver(state)  # the wire catches up
        dp.finalize_backward()
        assert list(state["launched"]) == list(range(dp.num_buckets)), state["launched"]
        diff = max_abs_diff(strip(named_grads(dp)), named_grads(ref))
        assert diff < 1e-6, f"grads differ from the reference by {diff:.3e} ({keeps_up})"


def held_bucket_launches_in_backward_once_the_wire_goes_idle() -> None:
    """hold_last_buckets(2, only_while_busy=True): the first held bucket is ready while
    the launched ones are still in flight (their futures pending), so it waits; the
    wire then catches up during backward (the futures complete after the first of the
    first layer's two gradients, whichever autograd accumulates first), and the hook
    of the other launches the held bucket, still inside backward, before the last
    parameter's gradient has accumulated."""
    model, xl, yl, _ = _model_batch_and_reference()
    dp = cadence.DataParallel(copy.deepcopy(model), bucket_cap_mb=0.001, first_bucket_cap_mb=None)
    params = list(dp.parameters())
    state: dict[str, Any] = {"accumulated": 0, "pending": [], "launched": {}, "delivers": False}

    def count(_: torch.Tensor) -> None:  # registered after the wrapper's: runs after it
        state["accumulated"] += 1

    def catch_up(_: torch.Tensor) -> None:
        if state.get("caught_up"):
            return
        state["caught_up"] = True
        for fut, buf in state["pending"]:  # what is in flight lands; later launches do not
            fut.set_result(buf)

    for p in params:
        p.register_post_accumulate_grad_hook(count)
    for p in dp.module[0].parameters():  # the last bucket's: backward reaches it last
        p.register_post_accumulate_grad_hook(catch_up)
    dp.register_comm_hook(state, _wire)
    dp.require_manual_backward_finalization = True
    dp.hold_last_buckets(2, only_while_busy=True)
    F.mse_loss(dp(xl), yl).backward()
    held_first = dp.num_buckets - 2
    assert held_first in state["launched"], f"the held bucket waited: {state['launched']}"
    assert state["launched"][held_first] < len(params), state["launched"]
    _deliver(state)
    dp.finalize_backward()
    assert sorted(state["launched"]) == list(range(dp.num_buckets)), state["launched"]


def held_only_while_busy_on_gloo_let_the_callers_collective_through() -> None:
    """The same hold on gloo's own all-reduce, with a collective of the caller's on a
    second group between backward and finalize (a held bucket's launch time depends
    on each rank's wire, so only another group is safe): over two steps the gradients
    are the reference's, backward launched at least every unheld bucket, and
    finalize all of them."""
    model = make_mlp()
    rank, world = dist.get_rank(), dist.get_world_size()
    other = cast(dist.ProcessGroup, dist.new_group())
    log = cadence.EventLog()
    dp = cadence.DataParallel(
        copy.deepcopy(model), bucket_cap_mb=0.001, first_bucket_cap_mb=None, event_log=log
    )
    dp.require_manual_backward_finalization = True
    dp.hold_last_buckets(2, only_while_busy=True)
    caller = cadence.Comm(other, name="caller")
    for step in range(2):
        x, y = global_batch(step, world)
        ref = copy.deepcopy(model)
        F.mse_loss(ref(x), y).backward()
        log.clear()
        F.mse_loss(dp(local(x, rank, world)), local(y, rank, world)).backward()
        assert dp.num_buckets - 2 <= log.count("all_reduce") <= dp.num_buckets, log.counts()
        caller.all_reduce(torch.ones(7))
        dp.finalize_backward()
        assert log.count("all_reduce") == dp.num_buckets, log.counts()
        diff = max_abs_diff(strip(named_grads(dp)), named_grads(ref))
        assert diff < 1e-6, f"step {step}: grads differ from the reference by {diff:.3e}"
        dp.zero_grad(set_to_none=True)


ACCUMULATION = ["no_sync", "setter", "deferred", "interleaved", "fwd_outside_bwd_inside"]

SCENARIOS = [
    *scenarios(
        synced_step_issues_one_all_reduce_per_bucket,
        manual_mode_launches_in_backward_and_matches_auto_order,
        finalize_with_nothing_pending_is_a_noop,
        accumulation_reduces_exactly_once,
        find_unused_adds_one_used_map_all_reduce,
        unused_on_one_rank_matches_ddp_and_launch_order,
    ),
    *cases(accumulation_matches_reference, "kind", ACCUMULATION),
    *scenarios(
        static_graph_handles_a_layer_checkpointed_twice,
        hook_firing_twice_names_the_parameter,
        reentrant_checkpointed_head_finalizes_after_outer_backward,
        parameters_and_buffers_broadcast_from_rank0,
    ),
    *cases(wire_dtype_or_comm_hook, "wire", list(WIRES)),
    *scenarios(
        torch_ddp_comm_hook_runs_unchanged,
        held_buckets_launch_at_finalize_after_the_callers_collective,
        hold_every_bucket_leaves_backward_silent,
        hold_last_buckets_misuse_is_refused,
        held_buckets_wait_only_while_busy,
        held_bucket_launches_in_backward_once_the_wire_goes_idle,
        held_only_while_busy_on_gloo_let_the_callers_collective_through,
    ),
]
