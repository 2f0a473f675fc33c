"""Rank bodies: DataParallel takes torch DDP's constructor and attributes, with the same effect.

Each case returns numbers that show the effect (collective counts from the event
log and from a counting comm hook on torch DDP, gradient differences), or "ok"
for an error whose message was checked.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import cadence
from cadence.testing import max_abs_diff, named_grads, run_subtests
from tests.dp.common import WIDTH, expect_error, global_batch, local, make_mlp, strip


def _counting_ddp(model: nn.Module, **kwargs: Any) -> tuple[DDP, list[int]]:
    """torch DDP with a comm hook that counts its bucket all-reduces (then all-reduces)."""
    ddp = DDP(copy.deepcopy(model), **kwargs)
    calls: list[int] = []

    # No annotations: torch checks them, and this module's are strings.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        state.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    ddp.register_comm_hook(calls, hook)
    return ddp, calls


def _step(model: nn.Module, step: int, micro: int = 0) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(100 * step + micro, world)
    F.mse_loss(model(local(x, rank, world)), local(y, rank, world)).backward()


def grad_accumulation() -> dict[str, float]:
    """nanoGPT's loop: ``require_backward_grad_sync = (micro == last)``; count all-reduces."""
    model = make_mlp()
    log = cadence.EventLog()
    dp = cadence.DataParallel(copy.deepcopy(model), event_log=log)
    ddp, ddp_calls = _counting_ddp(model)
    out = {"grad_ddp": 0.0}
    per_step = []
    for step in range(2):
        log.clear()
        ddp_calls.clear()
        for m in (dp, ddp):
            m.zero_grad(set_to_none=True)
        for micro in range(4):
            for m in (dp, ddp):
                m.require_backward_grad_sync = micro == 3
                _step(m, step, micro)
        per_step.append((log.count("all_reduce"), len(ddp_calls)))
        out["grad_ddp"] = max(out["grad_ddp"], max_abs_diff(named_grads(dp), named_grads(ddp)))
    out["cadence_all_reduces"] = float(per_step[1][0])
    out["ddp_all_reduces"] = float(per_step[1][1])
    out["num_buckets"] = float(dp.num_buckets)
    out["flag_reads_back"] = float(dp.require_backward_grad_sync)
    return out


def bucket_caps() -> dict[str, Any]:
    """Bucket counts equal torch DDP's (after its first-step rebuild) for each cap rule."""
    torch.manual_seed(0)
    # 6 x 256 KiB weights: more than the 1 MiB small first bucket.
    big = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    cases: dict[str, dict[str, Any]] = {
        "default": {},
        "explicit": {"bucket_cap_mb": 0.6},
        "list": {"bucket_cap_mb_list": [0.3, 1]},
    }

    def case(name: str) -> dict[str, float]:
        kwargs = cases[name]
        log = cadence.EventLog()
        dp = cadence.DataParallel(copy.deepcopy(big), event_log=log, **kwargs)
        ddp, calls = _counting_ddp(big, **kwargs)
        rank, world = dist.get_rank(), dist.get_world_size()
        for step in range(2):
            log.clear()
            calls.clear()
            x = torch.randn(world * 2, 256, generator=torch.Generator().manual_seed(step))
            for m in (dp, ddp):
                m.zero_grad()
                m(local(x, rank, world)).square().mean().backward()
        return {
            "cadence": float(log.count("all_reduce")),
            "ddp": float(len(calls)),
            "grad": max_abs_diff(named_grads(dp), named_grads(ddp)),
        }

    results = run_subtests({"name": list(cases)}, case)
    return {name: results[f"name={name!r}"] for name in cases}


def groups() -> dict[str, Any]:
    """``process_group=`` / ``device_mesh=`` decide who averages; two at once is refused."""
    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]
    mine = singles[rank]
    model = make_mlp()
    x, y = global_batch(0, world)
    local_ref = copy.deepcopy(model)
    F.mse_loss(local_ref(local(x, rank, world)), local(y, rank, world)).backward()
    out: dict[str, Any] = {}
    alone = cadence.DataParallel(copy.deepcopy(model), process_group=mine)
    _step(alone, 0)
    out["process_group_local"] = max_abs_diff(strip(named_grads(alone)), named_grads(local_ref))
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    meshed = cadence.DataParallel(copy.deepcopy(model), device_mesh=mesh)
    _step(meshed, 0)
    world_ddp = DDP(copy.deepcopy(model))
    _step(world_ddp, 0)
    out["device_mesh_vs_ddp"] = max_abs_diff(named_grads(meshed), named_grads(world_ddp))
    out["process_group_attr"] = float(alone.process_group is mine)
    out["both"] = expect_error(
        lambda: cadence.DataParallel(make_mlp(), process_group=mine, device_mesh=mesh),
        "process_group and device_mesh",
        "Pass one",
    )
    out["group_and_pg"] = expect_error(
        lambda: cadence.DataParallel(make_mlp(), group=mine, process_group=mine),
        "group and process_group",
    )
    return out


def _mp(**kwargs: Any) -> Any:
    from torch.nn.parallel.distributed import _MixedPrecision

    return _MixedPrecision(**kwargs)


def _static_graph_pending() -> str:
    dp = cadence.DataParallel(make_mlp())
    dp.require_manual_backward_finalization = True
    _step(dp, 0)
    msg = expect_error(dp._set_static_graph, "_set_static_graph()", "between steps")
    dp.finalize_backward()
    return msg


def devices() -> dict[str, str]:
    """device_ids / output_device: DDP's rules on a CPU module (errors that name the fix)."""
    return {
        "cpu_device_ids": expect_error(
            lambda: cadence.DataParallel(make_mlp(), device_ids=[0]),
            "device_ids=[0]",
            "model.to(local_rank)",
        ),
        "two_device_ids": expect_error(
            lambda: cadence.DataParallel(make_mlp(), device_ids=[0, 1]), "several devices"
        ),
        "output_device_alone": expect_error(
            lambda: cadence.DataParallel(make_mlp(), output_device=0), "needs device_ids"
        ),
        "dim_type": expect_error(
            lambda: cadence.DataParallel(make_mlp(), dim="0"),  # type: ignore[arg-type]
            "dim must be an int",
        ),
        "static_graph_pending": _static_graph_pending(),
        "delay_wrong_param": expect_error(
            lambda: cadence.DataParallel(
                make_mlp(),
                delay_all_reduce_named_params=[("0.weight", nn.Parameter(torch.ones(1)))],
            ),
            "delay_all_reduce_named_params names '0.weight'",
        ),
        "hook_without_delay": expect_error(
            lambda: cadence.DataParallel(
                make_mlp(), param_to_hook_all_reduce=nn.Parameter(torch.ones(1))
            ),
            "needs delay_all_reduce_named_params",
        ),
        "caps_list_and_first": expect_error(
            lambda: cadence.DataParallel(
                make_mlp(), bucket_cap_mb_list=[1.0], first_bucket_cap_mb=0.5
            ),
            "drop first_bucket_cap_mb",
        ),
        "negative_cap": expect_error(
            lambda: cadence.DataParallel(make_mlp(), bucket_cap_mb=-1), "must be positive"
        ),
        "reduce_dtype_disagree": expect_error(
            lambda: cadence.DataParallel(
                make_mlp(),
                mixed_precision=_mp(reduce_dtype=torch.bfloat16),
                reduce_dtype=torch.float16,
            ),
            "disagree",
        ),
        "mesh_2d": expect_error(
            lambda: cadence.DataParallel(
                make_mlp(),
                device_mesh=torch.distributed.device_mesh.init_device_mesh(
                    "cpu", (1, dist.get_world_size())
                ),
            ),
            "device_mesh must be 1-D",
        ),
        "none_ok": "ok"
        if cadence.DataParallel(make_mlp(), [], None, 1).device_ids is None
        else "device_ids not None",
    }


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(WIDTH, 1)
        self.other = nn.Linear(WIDTH, 1)
        self.register_buffer("stat", torch.full((3,), float(dist.get_rank())))
        self.register_buffer("private", torch.full((3,), float(dist.get_rank())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.other(x)


def _spread(t: torch.Tensor) -> float:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t.detach().contiguous())
    return max(float((e - everyone[0]).abs().max()) for e in everyone)


def buffers() -> dict[str, float]:
    """init_sync, broadcast_buffers vs forward_sync_buffers, require_forward_param_sync."""
    rank = dist.get_rank()
    out: dict[str, float] = {}
    x = torch.randn(2, WIDTH)
    log = cadence.EventLog()
    # broadcast_buffers=False (DDP's deprecated meaning): buffers skipped at init too.
    dp = cadence.DataParallel(_WithBuffer(), broadcast_buffers=False, event_log=log)
    out["bb_false_init_spread"] = _spread(dp.module.stat)
    # forward_sync_buffers=False: synced at init, not at forward.
    dp = cadence.DataParallel(_WithBuffer(), forward_sync_buffers=False, event_log=log)
    out["fsb_false_init_spread"] = _spread(dp.module.stat)
    dp.module.stat.fill_(rank)
    log.clear()
    dp(x)
    out["fsb_false_forward_broadcasts"] = float(log.count("broadcast"))
    # Default: broadcast at forward, unless require_forward_param_sync is off.
    dp = cadence.DataParallel(_WithBuffer(), event_log=log)
    dp.module.stat.fill_(rank)
    dp.require_forward_param_sync = False
    log.clear()
    dp(x)
    out["rfps_false_broadcasts"] = float(log.count("broadcast"))
    out["rfps_false_spread"] = _spread(dp.module.stat)
    dp.require_forward_param_sync = True
    dp(x)
    out["rfps_true_broadcasts"] = float(log.count("broadcast"))
    out["rfps_true_spread"] = _spread(dp.module.stat)
    # Which forwards broadcast, against DDP's own decision (will_sync_module_buffers):
    # a forward after a no_sync, flag-off or no-grad forward does not.
    pattern = {}
    for name, model in (
        ("ddp", DDP(_WithBuffer())),
        ("cadence", cadence.DataParallel(_WithBuffer(), event_log=log)),
    ):
        seen = []
        for kind in ("sync", "no_sync", "sync", "no_grad", "sync", "flag_off", "sync"):
            if name == "ddp":
                seen.append(float(model.will_sync_module_buffers()))
            log.clear()
            if kind == "no_grad":
                with torch.no_grad():
                    model(x)
            elif kind == "no_sync":
                with model.no_sync():
                    model(x).sum().backward()
            else:
                model.require_backward_grad_sync = kind != "flag_off"
                model(x).sum().backward()
                model.require_backward_grad_sync = True
            if name == "cadence":
                seen.append(float(log.count("broadcast")))
        pattern[name] = seen
    out["ddp_pattern"] = pattern["ddp"]  # type: ignore[assignment]
    out["cadence_pattern"] = pattern["cadence"]  # type: ignore[assignment]
    # init_sync=False: rank-dependent parameters stay rank-dependent.
    torch.manual_seed(rank)
    dp = cadence.DataParallel(nn.Linear(WIDTH, 1), init_sync=False, event_log=log)
    out["no_init_sync_spread"] = _spread(dp.module.weight)
    # _ddp_params_and_buffers_to_ignore: neither reduced nor broadcast.
    m = _WithBuffer()
    DDP._set_params_and_buffers_to_ignore_for_model(m, ["other.weight", "other.bias", "private"])
    with torch.no_grad():
        m.other.weight.fill_(rank)
    dp = cadence.DataParallel(m)
    out["ignored_param_spread"] = _spread(dp.module.other.weight)
    out["ignored_buffer_spread"] = _spread(dp.module.private)
    xl = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(rank))
    dp(xl).sum().backward()
    out["ignored_grad_spread"] = _spread(dp.module.other.weight.grad)
    out["reduced_grad_spread"] = _spread(dp.module.lin.weight.grad)
    return out


def delayed_and_precision() -> dict[str, Any]:
    """delay_all_reduce_named_params, mixed_precision, check_reduction, skip_all_reduce."""
    model = make_mlp()
    out: dict[str, Any] = {}
    log = cadence.EventLog()
    m = copy.deepcopy(model)
    delayed = [(n, p) for n, p in m.named_parameters() if n.startswith("2.")]
    dp = cadence.DataParallel(
        m,
        delay_all_reduce_named_params=delayed,
        param_to_hook_all_reduce=m[0].weight,
        event_log=log,
    )
    ddp = DDP(copy.deepcopy(model))
    for step in range(2):
        log.clear()
        for w in (dp, ddp):
            w.zero_grad()
            _step(w, step)
    events = log.collectives("all_reduce")
    out["delayed_buckets"] = float(dp.num_buckets)
    out["delayed_all_reduces"] = float(len(events))
    out["delayed_last_numel"] = float(events[-1].numel)
    out["delayed_numel"] = float(sum(p.numel() for _, p in delayed))
    out["delayed_grad_ddp"] = max_abs_diff(named_grads(dp), named_grads(ddp))
    # DDP's mixed precision with reduce_dtype only: the wire dtype.
    from torch.nn.parallel.distributed import _MixedPrecision

    dp = cadence.DataParallel(
        copy.deepcopy(model),
        mixed_precision=_MixedPrecision(reduce_dtype=torch.bfloat16),
        event_log=log,
    )
    log.clear()
    _step(dp, 0)
    out["mp_wire_dtypes"] = sorted({e.dtype for e in log.collectives("all_reduce")})
    out["mp_param_dtype"] = expect_error(
        lambda: cadence.DataParallel(
            make_mlp(), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16)
        ),
        "mixed_precision.param_dtype",
        "torch.autocast",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cadence.DataParallel(make_mlp(), check_reduction=True)
    out["check_reduction_warns"] = float(any(issubclass(w.category, FutureWarning) for w in caught))
    out["skip_needs_find_unused"] = expect_error(
        lambda: cadence.DataParallel(make_mlp(), skip_all_reduce_unused_params=True),
        "find_unused_parameters=True",
    )
    return out


def comm_hooks_and_toggles() -> dict[str, Any]:
    """torch's own comm hooks run unchanged; _set_static_graph; FSDP2 verbs."""
    model = make_mlp()
    out: dict[str, Any] = {}
    for name, hook in (
        ("allreduce", default_hooks.allreduce_hook),
        ("fp16", default_hooks.fp16_compress_hook),
    ):
        dp = cadence.DataParallel(copy.deepcopy(model))
        dp.register_comm_hook(None, hook)
        ddp = DDP(copy.deepcopy(model))
        ddp.register_comm_hook(None, hook)
        for w in (dp, ddp):
            _step(w, 0)
        out[f"torch_hook_{name}"] = max_abs_diff(named_grads(dp), named_grads(ddp))
    from tests.dp.bodies_timing import _Twice

    twice = _Twice()
    dp = cadence.DataParallel(copy.deepcopy(twice), bucket_cap_mb=0.001)
    dp._set_static_graph()
    ref = copy.deepcopy(twice)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        x, y = global_batch(step, world)
        dp.zero_grad()
        ref.zero_grad()
        F.mse_loss(dp(local(x, rank, world).requires_grad_()), local(y, rank, world)).backward()
        F.mse_loss(ref(x), y).backward()
    out["set_static_graph"] = max_abs_diff(strip(named_grads(dp)), named_grads(ref))
    out["static_graph_attr"] = float(dp.static_graph)
    # FSDP2's verbs, so a script switches wrappers with one line.
    log = cadence.EventLog()
    dp = cadence.DataParallel(copy.deepcopy(model), event_log=log)
    dp.set_reshard_after_forward(True)
    dp.set_reshard_after_backward(False)
    for micro in range(3):
        dp.set_is_last_backward(micro == 2)
        dp.set_requires_gradient_sync(micro == 2)
        _step(dp, 0, micro)
    out["fsdp_verbs_all_reduces"] = float(log.count("all_reduce"))
    return out


SECTIONS: dict[str, Callable[[], Any]] = {
    "grad_accumulation": grad_accumulation,
    "bucket_caps": bucket_caps,
    "groups": groups,
    "devices": devices,
    "buffers": buffers,
    "delayed_and_precision": delayed_and_precision,
    "comm_hooks_and_toggles": comm_hooks_and_toggles,
}


def ddp_surface() -> dict[str, Any]:
    return {name: fn() for name, fn in SECTIONS.items()}


__all__ = ["SECTIONS", "ddp_surface"]
