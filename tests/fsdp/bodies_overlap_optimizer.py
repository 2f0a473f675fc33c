"""Rank bodies for ``overlap_optimizer`` on fully_shard modules.

Each section trains the same fully_shard model on the same batches twice, with the
overlapped optimizer and with the plain ``backward(); step(); zero_grad()`` loop under
the same fully_shard settings, and reports whether the gathered parameters
(``full_tensor()``) and the optimizer state are bitwise equal (``torch.equal``), plus
the event order and what each refused call raised (as text, `tests._outcome.raised`).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import cadence
from cadence.fsdp import MixedPrecisionPolicy
from tests._outcome import raised
from tests.fsdp.common import Blocks, apply_cadence, loss_fn, make_batches

__all__ = ["OPTIMIZERS", "STEPS", "hsdp_suite", "overlap_optimizer_suite"]

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
    for kind, flag in [("foreach", {"foreach": True}), ("single", {"foreach": False})]
}

# One micro-step: (model, step index) -> None; it runs the backward(s) of one step.
Micro = Callable[[Any, int], None]
_BATCHES: dict[int, list[torch.Tensor]] = {}


def _rank_world(group: Any) -> tuple[int, int]:
    if isinstance(group, cadence.ParallelGroups):
        rank = group.coords.dp_replicate * group.topology.dp_shard + group.coords.dp_shard
        return rank, group.topology.dp_size
    return dist.get_rank(), dist.get_world_size()


def _batch(step: int, group: Any = None) -> torch.Tensor:
    if step not in _BATCHES:
        _BATCHES[step] = make_batches("blocks", 1, 8, seed=100 + step)[0]
    rank, world = _rank_world(group)
    return _BATCHES[step].chunk(world)[rank]


def _backward(m: Any, step: int, scale: float = 1.0, group: Any = None) -> None:
    (loss_fn(m, _batch(step, group)) * scale).backward()


def _model(
    *,
    group: Any = None,
    mp: MixedPrecisionPolicy | None = None,
    setup: Callable[[Any], None] | None = None,
) -> Any:
    torch.manual_seed(0)
    m = Blocks()
    kw: dict[str, Any] = {"event_log": cadence.EventLog()}
    if group is not None:
        kw["group"] = group
    if mp is not None:
        kw["mp_policy"] = mp
    m = apply_cadence(m, m.units(), **kw)
    if setup is not None:
        setup(m)
    return m


def _equal_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for k, sa in a["state"].items():
        sb = b["state"][k]
        if sa.keys() != sb.keys():
            return False
        for name, va in sa.items():
            vb = sb[name]
            if isinstance(va, DTensor):
                va, vb = va.full_tensor(), vb.full_tensor()
            same = torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb
            if not same:
                return False
    return True


def _params(m: nn.Module) -> list[torch.Tensor]:
    """Gathered values (collective); ``state_dict()`` reshards first."""
    return [
        (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for v in m.state_dict().values()
    ]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _marks(m: Any) -> int:
    return len(m._runtime.event_log.marks("fsdp.optimizer_step"))


def _run(
    make_opt: MakeOpt,
    *,
    overlap: bool,
    steps: int = STEPS,
    micro: Micro | None = None,
    clip: float | None = None,
    start: tuple[bytes, bytes, dict[str, Any]] | None = None,
    first: int = 0,
    **model_kw: Any,
) -> tuple[Any, torch.optim.Optimizer, Any]:
    """``steps`` steps with a StepLR schedule; ``micro`` replaces the one backward."""
    m = _model(**model_kw)
    opt = make_opt(list(m.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    if start is not None:
        m.load_state_dict(torch.load(io.BytesIO(start[0]), weights_only=False))
        opt.load_state_dict(torch.load(io.BytesIO(start[1]), weights_only=False))
        sched.load_state_dict(start[2])
    if overlap:
        m.overlap_optimizer(opt, max_grad_norm=clip)
    for step in range(first, first + steps):
        if micro is None:
            _backward(m, step, group=model_kw.get("group"))
        else:
            micro(m, step)
        if clip is not None and not overlap:
            torch.nn.utils.clip_grad_norm_(list(m.parameters()), clip)
        opt.step()
        opt.zero_grad()
        sched.step()
    return m, opt, sched


def _parity(make_opt: MakeOpt, plain_micro: Micro | None = None, **kw: Any) -> dict[str, Any]:
    a, oa, _ = _run(make_opt, overlap=True, **kw)
    if plain_micro is not None:
        kw["micro"] = plain_micro
    b, ob, _ = _run(make_opt, overlap=False, **kw)
    return {
        "params": _same(_params(a), _params(b)),
        "state": _equal_state(oa.state_dict(), ob.state_dict()),
        "early_steps": _marks(a),
        "units": len(a._runtime.units),
    }


def parity() -> dict[str, Any]:
    return {label: _parity(make) for label, make in OPTIMIZERS.items()}


def accumulation() -> dict[str, Any]:
    adam = OPTIMIZERS["adam,foreach"]
    stepped_in_no_sync: list[int] = []

    def no_sync(m: Any, step: int) -> None:
        m.set_requires_gradient_sync(False)
        before = _marks(m)
        _backward(m, 100 + step, 0.5)
        stepped_in_no_sync.append(_marks(m) - before)
        m.set_requires_gradient_sync(True)
        _backward(m, step, 0.5)

    def left_in_flight(m: Any, step: int) -> None:
        m.set_is_last_backward(False)  # every microbatch reduces; the last one waits all
        _backward(m, 100 + step, 0.5)
        m.set_is_last_backward(True)
        _backward(m, step, 0.5)

    out = {"no_sync": _parity(adam, micro=no_sync)}
    out["stepped_in_no_sync"] = stepped_in_no_sync[:STEPS]
    out["in_flight"] = _parity(adam, micro=left_in_flight)
    return out


def mixed_precision() -> dict[str, Any]:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    wire = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    return {
        "bf16_params": _parity(OPTIMIZERS["adamw,foreach"], mp=mp),
        "bf16_wire": _parity(OPTIMIZERS["sgd,single"], mp=wire),
    }


def settings() -> dict[str, Any]:
    """reshard_after_backward=False, explicit backward prefetch, more reductions in flight."""

    def setup(m: Any) -> None:
        m.set_reshard_after_backward(False)
        blocks = list(m.blocks)
        for i in range(1, len(blocks)):
            blocks[i].set_modules_to_backward_prefetch([blocks[i - 1]])
        m.set_max_inflight_reductions(3)

    return {
        "combined": _parity(OPTIMIZERS["adam,single"], setup=setup),
        "synchronous": _parity(
            OPTIMIZERS["sgd,foreach"], setup=lambda m: m.set_max_inflight_reductions(0)
        ),
    }


def checkpoint() -> dict[str, Any]:
    make = OPTIMIZERS["adamw,single"]
    a, oa, sched = _run(make, overlap=True, steps=3)
    _, ob, _ = _run(make, overlap=False, steps=3)
    out = {"state_after_3": _equal_state(oa.state_dict(), ob.state_dict())}
    model_buf, opt_buf = io.BytesIO(), io.BytesIO()
    torch.save(a.state_dict(), model_buf)
    torch.save(oa.state_dict(), opt_buf)
    saved = (model_buf.getvalue(), opt_buf.getvalue(), sched.state_dict())
    resumed, _, _ = _run(make, overlap=True, steps=2, start=saved, first=3)
    straight, _, _ = _run(make, overlap=False, steps=5)
    out["resumed"] = _same(_params(resumed), _params(straight))
    return out


def clipping() -> dict[str, Any]:
    make = OPTIMIZERS["sgd,foreach"]
    out: dict[str, Any] = {"global_norm": _parity(make, clip=0.05)}
    m = _model()
    opt = make(list(m.parameters()))
    m.overlap_optimizer(opt)
    _backward(m, 0)

    def clip_then_step() -> None:
        torch.nn.utils.clip_grad_norm_(list(m.parameters()), 0.05)
        opt.step()

    out["user_clip"] = raised(clip_then_step)
    return out


def _order_rows(m: Any) -> list[dict[str, Any]]:
    """Per stepped unit: after its own waits, before a later unit's reduce-scatter wait."""
    log = m._runtime.event_log
    ends = log.marks("backward_returned")[0].issue_t
    paths = [u.path for u in m._runtime.units]
    rs = log.collectives("reduce_scatter")
    ar = log.collectives("all_reduce")
    rows = []
    for i, s in enumerate(log.marks("fsdp.optimizer_step")):
        # Reductions are issued in post-backward order: the i-th step is of the i-th.
        later = rs[i + 1] if i + 1 < len(rs) else None
        rows.append(
            {
                "unit": paths.index(s.meta["unit"]),
                "after_own_wait": rs[i].wait_end_t is not None and rs[i].wait_end_t <= s.issue_t,
                "after_own_all_reduce": (not ar) or ar[i].wait_end_t <= s.issue_t,
                "later_issued_not_waited": later is None
                or (later.issue_t < s.issue_t and later.wait_start_t > s.issue_t),
                "before_backward_returned": s.issue_t < ends,
            }
        )
    return rows


def early_order(group: Any = None) -> dict[str, Any]:
    """Every reduce-scatter left in flight by backward: each unit steps before the next wait."""
    m = _model(group=group, setup=lambda m: m.set_max_inflight_reductions(8))
    opt = OPTIMIZERS["sgd,foreach"](list(m.parameters()))
    m.overlap_optimizer(opt)
    log = m._runtime.event_log
    log.clear()
    _backward(m, 0, group=group)
    log.mark("backward_returned")
    opt.step()
    rows = _order_rows(m)
    order = [u.path for u in m._runtime.units]
    return {"units": len(order), "rows": rows}


def manual() -> dict[str, Any]:
    make = OPTIMIZERS["adamw,single"]
    marks_at: dict[str, list[int]] = {"finalize": [], "wait": [], "step": []}

    def blocking(m: Any, step: int) -> None:
        m.set_manual_backward_finalization(True)
        _backward(m, step)
        n = _marks(m)
        m.finalize_backward()
        marks_at["finalize"].append(_marks(m) - n)

    def handle(m: Any, step: int) -> None:
        m.set_manual_backward_finalization(True)
        _backward(m, step)
        n = _marks(m)
        h = m.finalize_backward(async_op=True)
        assert _marks(m) == n, "nothing is stepped before the handle is waited"
        h.wait()
        marks_at["wait"].append(_marks(m) - n)

    def left_to_step(m: Any, step: int) -> None:
        m.set_manual_backward_finalization(True)
        _backward(m, step)
        marks_at["step"].append(_marks(m))  # opt.step() finalizes it

    return {
        "blocking": _parity(make, micro=blocking),
        "handle": _parity(make, micro=handle),
        "opt_step_finalizes": _parity(make, micro=left_to_step, plain_micro=blocking),
        "marks_at": marks_at,
    }


def hooks_and_scheduler() -> dict[str, Any]:
    m = _model()
    opt = OPTIMIZERS["adam,foreach"](list(m.parameters()))
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    m.register_optimizer(opt)  # its pre-hook does not refuse the overlapped step
    m.overlap_optimizer(opt)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=3)
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            lrs.append(opt.param_groups[0]["lr"])
            _backward(m, step)
            calls.append("backward_returned")
            opt.step()
            opt.zero_grad()
            sched.step()
    return {"calls": calls, "lrs": lrs, "warnings": [str(w.message) for w in caught]}


def refusals() -> dict[str, Any]:
    def build(opt_fn: MakeOpt) -> Callable[[], Any]:
        def go() -> None:
            m = _model()
            m.overlap_optimizer(opt_fn(list(m.parameters())))

        return go

    out: dict[str, Any] = {
        name: raised(build(fn))
        for name, fn in {
            "lbfgs": lambda p: torch.optim.LBFGS(p),
            "adagrad": lambda p: torch.optim.Adagrad(p),
        }.items()
    }

    def nested() -> None:
        m = _model()
        m.blocks[0].overlap_optimizer(torch.optim.SGD(list(m.parameters()), lr=0.1))

    out["nested"] = raised(nested)

    def fresh() -> tuple[Any, torch.optim.Optimizer]:
        m = _model()
        opt = torch.optim.SGD(list(m.parameters()), lr=0.1)
        m.overlap_optimizer(opt)
        return m, opt

    m, opt = fresh()
    _backward(m, 0)
    out["closure"] = raised(lambda: opt.step(lambda: 0.0))
    m, opt = fresh()
    _backward(m, 0)

    def lr_mid_step() -> None:
        opt.param_groups[0]["lr"] = 0.01
        opt.step()

    out["lr_mid_step"] = raised(lr_mid_step)
    m, opt = fresh()
    _backward(m, 0)
    out["second_forward"] = raised(lambda: _backward(m, 1))
    opt.step()  # the step is finished: training goes on
    _backward(m, 1)
    opt.step()
    out["recovers"] = True
    return out


def overlap_optimizer_suite() -> dict[str, Any]:
    return {
        "parity": parity(),
        "accumulation": accumulation(),
        "mixed_precision": mixed_precision(),
        "settings": settings(),
        "checkpoint": checkpoint(),
        "clipping": clipping(),
        "early_order": early_order(),
        "manual": manual(),
        "hooks": hooks_and_scheduler(),
        "refusals": refusals(),
    }


def hsdp_suite() -> dict[str, Any]:
    """World 4, HSDP 2 x 2: parity, and each unit stepped after its all-reduce."""
    pg = cadence.Topology(dp_replicate=2, dp_shard=2, pp=1).build()
    return {
        "parity": _parity(OPTIMIZERS["adamw,foreach"], group=pg),
        "early_order": early_order(group=pg),
    }
