"""Rank bodies for `DataParallel.overlap_optimizer`; `overlap_optimizer_suite` runs them all.

Each section trains the same model on the same batches twice, with the overlapped
optimizer and with the plain ``backward(); step(); zero_grad()`` loop, and reports
whether parameters and optimizer state are bitwise equal (``torch.equal``), plus the
event order and the errors it checks.
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
from tests.dp.common import expect_error, global_batch, local, make_mlp

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


def _parity(make_opt: MakeOpt, plain_micro: Any = None, **kw: Any) -> dict[str, Any]:
    a, oa, _ = _run(make_opt, overlap=True, **kw)
    if plain_micro is not None:
        kw["micro"] = plain_micro
    b, ob, _ = _run(make_opt, overlap=False, **kw)
    return {
        "params": _same(_params(a), _params(b)),
        "state": _equal_state(oa.state_dict(), ob.state_dict()),
        "early_steps": len(a.event_log.marks("dp.optimizer_step")),
    }


def parity() -> dict[str, Any]:
    return {label: _parity(make) for label, make in OPTIMIZERS.items()}


def accumulation() -> dict[str, Any]:
    adam = OPTIMIZERS["adam,foreach"]

    def with_no_sync(dp: cadence.DataParallel, step: int) -> None:
        with dp.no_sync():
            _loss(dp, 100 + step).backward()
            _loss(dp, 200 + step).backward()
        before = len(dp.event_log.marks("dp.optimizer_step"))
        stepped_in_no_sync.append(before - counted[-1] if counted else before)
        _loss(dp, step).backward()
        counted.append(len(dp.event_log.marks("dp.optimizer_step")))

    def with_flag(dp: cadence.DataParallel, step: int) -> None:
        dp.require_backward_grad_sync = False
        _loss(dp, 100 + step).backward()
        dp.require_backward_grad_sync = True
        _loss(dp, step).backward()

    stepped_in_no_sync: list[int] = []
    counted: list[int] = []
    out = {"no_sync": _parity(adam, micro=with_no_sync)}
    out["stepped_in_no_sync"] = stepped_in_no_sync[:STEPS]
    out["flag"] = _parity(adam, micro=with_flag)
    return out


def mixed_precision() -> dict[str, Any]:
    return {
        "bf16_wire": _parity(OPTIMIZERS["adamw,foreach"], dp_kw={"reduce_dtype": torch.bfloat16}),
        "bucket_view": _parity(OPTIMIZERS["sgd,single"], dp_kw={"gradient_as_bucket_view": True}),
    }


def checkpoint() -> dict[str, Any]:
    make = OPTIMIZERS["adam,single"]
    a, oa, sched = _run(make, overlap=True, steps=3)
    _, ob, _ = _run(make, overlap=False, steps=3)
    out = {"state_after_3": _equal_state(oa.state_dict(), ob.state_dict())}
    saved = (a.state_dict(), oa.state_dict(), sched.state_dict())
    resumed, _, _ = _run(make, overlap=True, steps=2, start=saved, first=3)
    straight, _, _ = _run(make, overlap=False, steps=5)
    out["resumed"] = _same(_params(resumed), _params(straight))
    return out


def clipping() -> dict[str, Any]:
    make = OPTIMIZERS["sgd,foreach"]
    out: dict[str, Any] = {"global_norm": _parity(make, clip=0.05)}
    dp = _model()
    opt = make(list(dp.parameters()))
    dp.overlap_optimizer(opt)
    _loss(dp, 0).backward()

    def clip_then_step() -> None:
        torch.nn.utils.clip_grad_norm_(list(dp.parameters()), 0.05)
        opt.step()

    out["user_clip"] = expect_error(clip_then_step, "max_grad_norm=", "were changed after")
    return out


def early_order() -> dict[str, Any]:
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
    rows = []
    for s in steps:
        b = s.meta["bucket"]
        later = reduces[b + 1] if b + 1 < len(reduces) else None
        rows.append(
            {
                "bucket": b,
                "after_own_wait": reduces[b].wait_end_t <= s.issue_t,
                "later_issued_not_waited": later is None
                or (later.issue_t < s.issue_t < later.wait_start_t),
                "before_backward_returned": s.issue_t < ends,
            }
        )
    return {"buckets": dp.num_buckets, "rows": rows}


def manual() -> dict[str, Any]:
    make = OPTIMIZERS["adamw,single"]
    marks_at: dict[str, list[int]] = {"finalize": [], "wait": [], "step": []}

    def counter(dp: cadence.DataParallel) -> int:
        return len(dp.event_log.marks("dp.optimizer_step"))

    def blocking(dp: cadence.DataParallel, step: int) -> None:
        dp.require_manual_backward_finalization = True
        _loss(dp, step).backward()
        n = counter(dp)
        dp.finalize_backward()
        marks_at["finalize"].append(counter(dp) - n)

    def handle(dp: cadence.DataParallel, step: int) -> None:
        dp.require_manual_backward_finalization = True
        _loss(dp, step).backward()
        n = counter(dp)
        h = dp.finalize_backward(async_op=True)
        assert counter(dp) == n, "nothing is stepped before the handle is waited"
        h.wait()
        marks_at["wait"].append(counter(dp) - n)

    def left_to_step(dp: cadence.DataParallel, step: int) -> None:
        dp.require_manual_backward_finalization = True
        _loss(dp, step).backward()
        marks_at["step"].append(counter(dp))  # opt.step() finalizes it

    return {
        "blocking": _parity(make, micro=blocking),
        "handle": _parity(make, micro=handle),
        "opt_step_finalizes": _parity(make, micro=left_to_step, plain_micro=blocking),
        "marks_at": marks_at,
    }


def hooks_and_scheduler() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for when in ("before", "after"):
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
        out[when] = {
            "calls": calls,
            "lrs": lrs,
            "warnings": [str(w.message) for w in caught],
            "empty_step_unchanged": _same(before, _params(dp)),
        }
    return out


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


def ownership() -> dict[str, Any]:
    out = {}
    for frozen in (False, True):
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
        out["first_layer_left_out" if frozen else "extra_param"] = {
            "params": _same(res[0][0], res[1][0]),
            "left_out_unchanged": res[0][1],
        }
    return out


def refusals() -> dict[str, Any]:
    def build(opt_fn: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> Callable[[], Any]:
        def go() -> None:
            dp = _model()
            dp.overlap_optimizer(opt_fn(list(dp.parameters())))

        return go

    class MySGD(torch.optim.SGD):
        pass

    out = {
        name: expect_error(build(fn), "cannot step", "LBFGS", "Fix:")
        for name, fn in {
            "lbfgs": lambda p: torch.optim.LBFGS(p),
            "adagrad": lambda p: torch.optim.Adagrad(p),
            "rmsprop": lambda p: torch.optim.RMSprop(p),
            "subclass": lambda p: MySGD(p, lr=0.1),
        }.items()
    }
    out["differentiable"] = expect_error(
        build(lambda p: torch.optim.SGD(p, lr=0.1, differentiable=True)), "differentiable"
    )

    def fresh() -> tuple[cadence.DataParallel, torch.optim.Optimizer]:
        dp = _model()
        opt = torch.optim.SGD(list(dp.parameters()), lr=0.1)
        dp.overlap_optimizer(opt)
        return dp, opt

    dp, opt = fresh()
    _loss(dp, 0).backward()
    out["closure"] = expect_error(lambda: opt.step(lambda: 0.0), "closure")
    dp, opt = fresh()
    _loss(dp, 0).backward()

    def lr_mid_step() -> None:
        opt.param_groups[0]["lr"] = 0.01
        opt.step()

    out["lr_mid_step"] = expect_error(lr_mid_step, "'lr' changed", "Fix:")
    dp, opt = fresh()
    _loss(dp, 0).backward()
    out["second_forward"] = expect_error(lambda: _loss(dp, 1), "no_sync()", "opt.step()")
    opt.step()  # the step is finished: training goes on
    _loss(dp, 1).backward()
    opt.step()
    out["recovers"] = True
    return out


def overlap_optimizer_suite() -> dict[str, Any]:
    return {
        "parity": parity(),
        "accumulation": accumulation(),
        "mixed_precision": mixed_precision(),
        "checkpoint": checkpoint(),
        "clipping": clipping(),
        "early_order": early_order(),
        "manual": manual(),
        "hooks": hooks_and_scheduler(),
        "ownership": ownership(),
        "refusals": refusals(),
    }
