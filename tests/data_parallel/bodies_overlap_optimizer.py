"""Scenarios for `DataParallel.overlap_optimizer`; one world-2 launch runs `SCENARIOS`.

Most scenarios train the same model on the same batches twice, with the overlapped
optimizer and with the plain ``backward(); step(); zero_grad()`` loop, and assert
that parameters and optimizer state are bitwise equal (``torch.equal``); others
assert the event order or the errors.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cadence
from tests._scenarios import assert_raises, cases, scenarios
from tests.data_parallel.common import global_batch, local, make_mlp

STEPS = 4
MakeOpt = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, MakeOpt] = {
    f"{name},{kind}": (
        lambda params, cls=cls, kw=kw, flag=flag: cls(params, **kw, **flag)  # type: ignore[misc]
    )
    for name, cls, kw in [
        ("sgd", torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
        ("adam", torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}),
        ("adamw", torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    ]
    for kind, flag in [
        ("foreach", {"foreach": True}),
        ("single", {"foreach": False}),
        ("fused", {"fused": True}),
    ]
}


def _model(**kw: Any) -> cadence.DataParallel:
    # Tiny caps: five buckets, so several are in flight while earlier ones step.
    return cadence.DataParallel(make_mlp(), bucket_cap_mb=0.001, first_bucket_cap_mb=None, **kw)


def _loss(dp: nn.Module, step: int) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(step, world)
    return F.mse_loss(dp(local(x, rank, world)), local(y, rank, world))


def _equal_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for k, sa in a["state"].items():
        sb = b["state"][k]
        if sa.keys() != sb.keys():
            return False
        for name, va in sa.items():
            vb = sb[name]
            same = torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb
            if not same:
                return False
    return True


def _params(m: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _run(
    make_opt: MakeOpt,
    *,
    overlap: bool,
    steps: int = STEPS,
    micro: Callable[[cadence.DataParallel, int], None] | None = None,
    dp_kw: dict[str, Any] | None = None,
    clip: float | None = None,
    start: tuple[dict[str, Any], ...] | None = None,
    first: int = 0,
) -> tuple[cadence.DataParallel, torch.optim.Optimizer, Any]:
    """``steps`` steps with a StepLR schedule; ``micro`` replaces the one backward."""
    dp = _model(**(dp_kw or {}))
    opt = make_opt(list(dp.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    if start is not None:
        dp.load_state_dict(start[0])
        opt.load_state_dict(start[1])
        sched.load_state_dict(start[2])
    if overlap:
        dp.overlap_optimizer(opt, max_grad_norm=clip)
    for step in range(first, first + steps):
        if micro is None:
            _loss(dp, step).backward()
        else:
            micro(dp, step)
        if clip is not None and not overlap:
            torch.nn.utils.clip_grad_norm_(list(dp.parameters()), clip)
        opt.step()
        opt.zero_grad()
        sched.step()
    return dp, opt, sched


def _bitwise(
    make_opt: MakeOpt,
    plain_micro: Any = None,
    *,
    stepped_early: bool = True,
    **kw: Any,
) -> None:
    """Overlapped and plain training end bitwise equal; buckets stepped early or not."""
    a, oa, _ = _run(make_opt, overlap=True, **kw)
    if plain_micro is not None:
        kw["micro"] = plain_micro
    b, ob, _ = _run(make_opt, overlap=False, **kw)
    assert _same(_params(a), _params(b)), "parameters differ from the plain loop"
    assert _equal_state(oa.state_dict(), ob.state_dict()), (
        "optimizer state differs from the plain loop"
    )
    early = len(a.event_log.marks("dp.optimizer_step"))
    assert (early > 0) is stepped_early, f"{early} buckets stepped early"


def params_and_state_are_bitwise_the_plain_loops(optimizer: str) -> None:
    _bitwise(OPTIMIZERS[optimizer])


def no_sync_accumulation_steps_nothing_early_and_matches() -> None:
    stepped_in_no_sync: list[int] = []
    counted: list[int] = []

    def with_no_sync(dp: cadence.DataParallel, step: int) -> None:
        with dp.no_sync():
            _loss(dp, 100 + step).backward()
            _loss(dp, 200 + step).backward()
        before = len(dp.event_log.marks("dp.optimizer_step"))
        stepped_in_no_sync.append(before - counted[-1] if counted else before)
        _loss(dp, step).backward()
        counted.append(len(dp.event_log.marks("dp.optimizer_step")))

    _bitwise(OPTIMIZERS["adam,foreach"], micro=with_no_sync)
    # The overlapped run's steps come first.
    assert stepped_in_no_sync[:STEPS] == [0] * STEPS, stepped_in_no_sync


def require_backward_grad_sync_accumulation_matches() -> None:
    def with_flag(dp: cadence.DataParallel, step: int) -> None:
        dp.require_backward_grad_sync = False
        _loss(dp, 100 + step).backward()
        dp.require_backward_grad_sync = True
        _loss(dp, step).backward()

    _bitwise(OPTIMIZERS["adam,foreach"], micro=with_flag)


def bf16_wire_matches() -> None:
    _bitwise(OPTIMIZERS["adamw,foreach"], dp_kw={"reduce_dtype": torch.bfloat16})


def bucket_views_match() -> None:
    _bitwise(OPTIMIZERS["sgd,single"], dp_kw={"gradient_as_bucket_view": True})


def checkpoint_round_trip_saves_the_plain_state_and_resumes_bitwise() -> None:
    make = OPTIMIZERS["adam,single"]
    a, oa, sched = _run(make, overlap=True, steps=3)
    _, ob, _ = _run(make, overlap=False, steps=3)
    assert _equal_state(oa.state_dict(), ob.state_dict()), "state after 3 steps differs"
    saved = (a.state_dict(), oa.state_dict(), sched.state_dict())
    resumed, _, _ = _run(make, overlap=True, steps=2, start=saved, first=3)
    straight, _, _ = _run(make, overlap=False, steps=5)
    assert _same(_params(resumed), _params(straight)), "resumed parameters differ"


def max_grad_norm_clips_by_the_global_norm_and_steps_nothing_early() -> None:
    _bitwise(OPTIMIZERS["sgd,foreach"], clip=0.05, stepped_early=False)


def a_clip_after_buckets_stepped_raises_naming_max_grad_norm() -> None:
    dp = _model()
    opt = OPTIMIZERS["sgd,foreach"](list(dp.parameters()))
    dp.overlap_optimizer(opt)
    _loss(dp, 0).backward()

    def clip_then_step() -> None:
        torch.nn.utils.clip_grad_norm_(list(dp.parameters()), 0.05)
        opt.step()

    assert_raises(clip_then_step, "max_grad_norm=", "were changed after")


def each_bucket_steps_while_the_next_is_in_flight_before_backward_returns() -> None:
    """Per bucket: stepped after its own wait, before the next bucket's wait and backward's end."""
    dp = _model()
    opt = OPTIMIZERS["sgd,foreach"](list(dp.parameters()))
    dp.overlap_optimizer(opt)
    log = dp.event_log
    log.clear()
    _loss(dp, 0).backward()
    log.mark("backward_returned")
    opt.step()
    log.mark("step_returned")
    ends = log.marks("backward_returned")[0].issue_t
    reduces = log.collectives("all_reduce", group="dp")
    steps = log.marks("dp.optimizer_step")
    assert dp.num_buckets >= 2, f"{dp.num_buckets} buckets"
    stepped = [s.meta["bucket"] for s in steps]
    assert stepped == list(range(dp.num_buckets)), f"buckets stepped: {stepped}"
    for s in steps:
        b = s.meta["bucket"]
        later = reduces[b + 1] if b + 1 < len(reduces) else None
        assert reduces[b].wait_end_t <= s.issue_t, f"bucket {b} stepped before its own wait"
        assert later is None or (later.issue_t < s.issue_t < later.wait_start_t), (
            f"bucket {b} stepped while the next one was not in flight"
        )
        assert s.issue_t < ends, f"bucket {b} stepped after backward returned"


def _counter(dp: cadence.DataParallel) -> int:
    return len(dp.event_log.marks("dp.optimizer_step"))


def _blocking(marks: list[tuple[int, int]]) -> Callable[[cadence.DataParallel, int], None]:
    """A manual window finalized by ``finalize_backward()``; records (stepped, buckets)."""

    def blocking(dp: cadence.DataParallel, step: int) -> None:
        dp.require_manual_backward_finalization = True
        _loss(dp, step).backward()
        n = _counter(dp)
        dp.finalize_backward()
        marks.append((_counter(dp) - n, dp.num_buckets))

    return blocking


def manual_finalize_backward_steps_every_bucket() -> None:
    marks: list[tuple[int, int]] = []
    _bitwise(OPTIMIZERS["adamw,single"], micro=_blocking(marks))
    # The overlapped run's steps come first: finalize_backward() stepped every bucket.
    assert len(marks) >= STEPS and all(stepped == n for stepped, n in marks[:STEPS]), marks


def manual_handle_wait_steps_every_bucket() -> None:
    marks: list[tuple[int, int]] = []

    def handle(dp: cadence.DataParallel, step: int) -> None:
        dp.require_manual_backward_finalization = True
        _loss(dp, step).backward()
        n = _counter(dp)
        h = dp.finalize_backward(async_op=True)
        assert _counter(dp) == n, "nothing is stepped before the handle is waited"
        h.wait()
        marks.append((_counter(dp) - n, dp.num_buckets))

    _bitwise(OPTIMIZERS["adamw,single"], micro=handle)
    assert len(marks) >= STEPS and all(stepped == n for stepped, n in marks[:STEPS]), marks


def manual_window_left_pending_is_finalized_by_opt_step() -> None:
    marks: list[tuple[int, int]] = []

    def left_to_step(dp: cadence.DataParallel, step: int) -> None:
        dp.require_manual_backward_finalization = True
        _loss(dp, step).backward()
        marks.append((_counter(dp), dp.num_buckets))  # opt.step() finalizes it

    _bitwise(OPTIMIZERS["adamw,single"], micro=left_to_step, plain_micro=_blocking([]))
    # Nothing stepped by backward: each step's buckets were stepped by the opt.step() before.
    assert len(marks) == STEPS, marks
    assert [stepped for stepped, _ in marks] == [n * k for k, (_, n) in enumerate(marks)], marks


def hooks_and_scheduler_see_one_step_per_opt_step(when: str) -> None:
    dp = _model()
    opt = OPTIMIZERS["adam,foreach"](list(dp.parameters()))
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_, c=calls: c.append("pre"))
    opt.register_step_post_hook(lambda *_, c=calls: c.append("post"))
    dp.register_optimizer(opt)  # its pre-hook does not refuse the overlapped step
    if when == "before":
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=3)
        dp.overlap_optimizer(opt)
    else:
        dp.overlap_optimizer(opt)
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=3)
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            lrs.append(opt.param_groups[0]["lr"])
            _loss(dp, step).backward()
            calls.append("backward_returned")
            opt.step()
            opt.zero_grad()
            sched.step()
        before = _params(dp)
        opt.step()  # nothing to do: no gradients
        calls.append("empty_step_returned")
    # The pre-hook runs before the first bucket steps (inside backward), post at step.
    expected = ["pre", "backward_returned", "post"] * 3 + ["pre", "post", "empty_step_returned"]
    assert calls == expected, calls
    assert [str(w.message) for w in caught] == [], [str(w.message) for w in caught]
    want = [0.005, 0.01 * 2 / 3, 0.01 * 5 / 6]
    assert len(lrs) == len(want) and all(
        abs(a - b) <= 1e-6 * abs(b) + 1e-12 for a, b in zip(lrs, want)
    ), lrs
    assert _same(before, _params(dp)), "an empty step changed the parameters"


class _Extra(nn.Module):
    """A wrapped MLP and a scale outside the wrapper, both in one optimizer."""

    def __init__(self, frozen_in_opt: bool) -> None:
        super().__init__()
        self.dp = _model()
        torch.manual_seed(1)
        self.scale = nn.Parameter(torch.ones(1) + 0.1 * torch.randn(1))
        self.frozen_in_opt = frozen_in_opt

    def opt_params(self) -> list[nn.Parameter]:
        owned = list(self.dp.parameters())
        if self.frozen_in_opt:
            owned = owned[2:]  # the first Linear is owned but not in the optimizer
        return [self.scale, *owned]


def _ownership(frozen: bool) -> tuple[bool, bool]:
    """(overlapped == plain parameters, the left-out first layer unchanged when overlapped)."""
    res = []
    for overlap in (True, False):
        m = _Extra(frozen)
        first = _params(m.dp)[:2]
        opt = torch.optim.AdamW(m.opt_params(), lr=0.01, foreach=True)
        if overlap:
            m.dp.overlap_optimizer(opt)
        for step in range(STEPS):
            (_loss(m.dp, step) * m.scale).sum().backward()
            opt.step()
            opt.zero_grad()
        res.append((_params(m), _same(first, _params(m.dp)[:2])))
    return _same(res[0][0], res[1][0]), res[0][1]


def params_outside_the_wrapper_are_stepped_at_opt_step() -> None:
    same, _ = _ownership(frozen=False)
    assert same, "parameters differ from the plain loop"


def owned_params_missing_from_the_optimizer_are_not_stepped() -> None:
    same, left_out_unchanged = _ownership(frozen=True)
    assert same, "parameters differ from the plain loop"
    assert left_out_unchanged, "the first layer, not in the optimizer, changed"


class _MySGD(torch.optim.SGD):
    pass


# Optimizers not proven per-parameter: name -> (make, message fragments).
NOT_PER_PARAMETER: dict[str, tuple[MakeOpt, tuple[str, ...]]] = {
    "lbfgs": (lambda p: torch.optim.LBFGS(p), ("cannot step", "LBFGS", "Fix:")),
    "adagrad": (lambda p: torch.optim.Adagrad(p), ("cannot step", "LBFGS", "Fix:")),
    "rmsprop": (lambda p: torch.optim.RMSprop(p), ("cannot step", "LBFGS", "Fix:")),
    "subclass": (lambda p: _MySGD(p, lr=0.1), ("cannot step", "LBFGS", "Fix:")),
    "differentiable": (
        lambda p: torch.optim.SGD(p, lr=0.1, differentiable=True),
        ("differentiable",),
    ),
}


def optimizer_not_proven_per_parameter_is_refused(optimizer: str) -> None:
    make, fragments = NOT_PER_PARAMETER[optimizer]

    def go() -> None:
        dp = _model()
        dp.overlap_optimizer(make(list(dp.parameters())))

    assert_raises(go, *fragments)


def _after_backward() -> tuple[cadence.DataParallel, torch.optim.Optimizer]:
    dp = _model()
    opt = torch.optim.SGD(list(dp.parameters()), lr=0.1)
    dp.overlap_optimizer(opt)
    _loss(dp, 0).backward()
    return dp, opt


def a_closure_is_refused() -> None:
    _, opt = _after_backward()
    assert_raises(lambda: opt.step(lambda: 0.0), "closure")


def lr_changed_mid_step_is_refused() -> None:
    _, opt = _after_backward()

    def lr_mid_step() -> None:
        opt.param_groups[0]["lr"] = 0.01
        opt.step()

    assert_raises(lr_mid_step, "'lr' changed", "Fix:")


def a_second_forward_before_opt_step_is_refused_and_training_recovers() -> None:
    dp, opt = _after_backward()
    assert_raises(lambda: _loss(dp, 1), "no_sync()", "opt.step()")
    opt.step()  # the step is finished: training goes on
    _loss(dp, 1).backward()
    opt.step()


SCENARIOS = [
    *cases(params_and_state_are_bitwise_the_plain_loops, "optimizer", list(OPTIMIZERS)),
    *scenarios(
        no_sync_accumulation_steps_nothing_early_and_matches,
        require_backward_grad_sync_accumulation_matches,
        bf16_wire_matches,
        bucket_views_match,
        checkpoint_round_trip_saves_the_plain_state_and_resumes_bitwise,
        max_grad_norm_clips_by_the_global_norm_and_steps_nothing_early,
        a_clip_after_buckets_stepped_raises_naming_max_grad_norm,
        each_bucket_steps_while_the_next_is_in_flight_before_backward_returns,
        manual_finalize_backward_steps_every_bucket,
        manual_handle_wait_steps_every_bucket,
        manual_window_left_pending_is_finalized_by_opt_step,
    ),
    *cases(hooks_and_scheduler_see_one_step_per_opt_step, "when", ["before", "after"]),
    *scenarios(
        params_outside_the_wrapper_are_stepped_at_opt_step,
        owned_params_missing_from_the_optimizer_are_not_stepped,
    ),
    *cases(optimizer_not_proven_per_parameter_is_refused, "optimizer", list(NOT_PER_PARAMETER)),
    *scenarios(
        a_closure_is_refused,
        lr_changed_mid_step_is_refused,
        a_second_forward_before_opt_step_is_refused_and_training_recovers,
    ),
]
