"""Scenarios: a wrapped model pickles and deep-copies as torch DDP's does.

torch's own ``test_DistributedDataParallelCPU`` saves the wrapped model mid-training
with ``torch.save(model)``, reloads it and trains on; these scenarios pin the same
contract with parity against DDP doing the same, plus what cannot travel. `SCENARIOS`
runs in one world-2 launch.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import cadence
from cadence.testing import max_abs_diff, named_grads, named_params
from tests._scenarios import assert_raises, cases, scenarios
from tests.data_parallel.common import global_batch, local, make_mlp, strip


def _saved_and_loaded(model: Any) -> Any:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)  # a whole module: not a weights-only load


COPIES = {"torch_save": _saved_and_loaded, "deepcopy": copy.deepcopy}


def _train(model: Any, steps: range, *, manual: bool = False) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        x, y = global_batch(step, world)
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(local(x, rank, world)), local(y, rank, world)).backward()
        if manual:
            model.finalize_backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad


def a_copied_wrapper_trains_on_as_ddp_does(how: str) -> None:
    """Train 2 steps, copy the wrapper (torch.save/load or deepcopy), train 2 more: the
    copy's gradients and parameters equal DDP's copied the same way."""
    rank = dist.get_rank()
    model = make_mlp(5)
    dp = cadence.DataParallel(copy.deepcopy(model), bucket_cap_mb=0.001)
    ddp = DDP(copy.deepcopy(model), bucket_cap_mb=0.001)
    _train(dp, range(2))
    _train(ddp, range(2))
    dp2, ddp2 = COPIES[how](dp), COPIES[how](ddp)
    assert type(dp2) is cadence.DataParallel, f"rank {rank}: rebuilt as {type(dp2)}"
    assert dp2.num_buckets == dp.num_buckets, f"{dp2.num_buckets} vs {dp.num_buckets} buckets"
    shared = {id(p) for p in dp.parameters()} & {id(p) for p in dp2.parameters()}
    assert not shared, f"rank {rank}: the copy shares {len(shared)} parameters with the original"
    _train(dp2, range(2, 4))
    _train(ddp2, range(2, 4))
    grads = max_abs_diff(strip(named_grads(dp2)), strip(named_grads(ddp2)))
    params = max_abs_diff(strip(named_params(dp2)), strip(named_params(ddp2)))
    assert grads < 1e-6 and params < 1e-6, f"rank {rank} {how}: grads {grads}, params {params}"
    # The original still works beside its copy: its hooks feed its own reducer only.
    _train(dp, range(2, 3))


def a_copied_wrapper_keeps_its_flags() -> None:
    """Flags set after construction travel: manual finalization, sync, buffer broadcast."""
    dp = cadence.DataParallel(make_mlp(5), find_unused_parameters=True, broadcast_buffers=False)
    dp.require_manual_backward_finalization = True
    dp.require_backward_grad_sync = False
    dp2 = _saved_and_loaded(dp)
    got = (
        dp2.require_manual_backward_finalization,
        dp2.require_backward_grad_sync,
        dp2.broadcast_buffers,
        dp2._reducer.find_unused,
    )
    assert got == (True, False, False, True), f"flags after the round trip: {got}"
    dp2.require_backward_grad_sync = True
    _train(dp2, range(1), manual=True)  # manual mode survived: finalize_backward is needed


def loading_on_one_rank_issues_no_collective() -> None:
    """Rank 0 alone loads the saved wrapper (as a checkpoint reader would): no collective,
    so rank 1 is never waited for."""
    dp = cadence.DataParallel(make_mlp(5))
    buf = io.BytesIO()
    torch.save(dp, buf)
    if dist.get_rank() == 0:
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert loaded.event_log.count("broadcast") == 0, loaded.event_log.counts()
        assert loaded.event_log.count("all_gather") == 0, loaded.event_log.counts()
    dist.barrier()


def what_cannot_travel_is_refused(case: str) -> None:
    """What a pickle cannot carry is refused by name, before anything is written."""
    model = make_mlp(5)
    if case == "subgroup":
        group = dist.new_group([0, 1])
        dp = cadence.DataParallel(model, process_group=group)
        assert_raises(lambda: copy.deepcopy(dp), "other than the default one", "model.module")
    elif case == "comm_hook":
        dp = cadence.DataParallel(model)
        dp.register_comm_hook(None, default_hooks.allreduce_hook)
        assert_raises(lambda: _saved_and_loaded(dp), "comm hook", "state_dict")
    elif case == "overlap_optimizer":
        dp = cadence.DataParallel(model)
        dp.overlap_optimizer(torch.optim.SGD(dp.parameters(), lr=0.1))
        assert_raises(lambda: copy.deepcopy(dp), "stepped per bucket")
    else:
        dp = cadence.DataParallel(model)
        dp.require_manual_backward_finalization = True
        dp(torch.randn(2, 16)).sum().backward()
        assert_raises(lambda: copy.deepcopy(dp), "pending", "finalize_backward()")
        dp.finalize_backward()
        copy.deepcopy(dp)  # finalized: it copies


SCENARIOS = [
    *cases(a_copied_wrapper_trains_on_as_ddp_does, "how", list(COPIES)),
    *scenarios(a_copied_wrapper_keeps_its_flags, loading_on_one_rank_issues_no_collective),
    *cases(
        what_cannot_travel_is_refused,
        "case",
        ["subgroup", "comm_hook", "overlap_optimizer", "pending_reduction"],
    ),
]
