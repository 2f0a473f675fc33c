"""Scenarios: DataParallel takes torch DDP's constructor and attributes, with the same effect.

Each scenario shows the effect (collective counts from the event log and from a
counting comm hook on torch DDP, gradient differences) or the error, and asserts it.
`SCENARIOS` runs in one world-2 launch.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import cadence
from cadence.testing import max_abs_diff, named_grads
from tests._scenarios import assert_raises, cases, scenarios
from tests.data_parallel.common import WIDTH, global_batch, local, make_mlp, strip


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


def require_backward_grad_sync_is_honoured() -> None:
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
    # Four micro-steps, sync only on the last: one all-reduce per bucket per step, as DDP.
    ours, ddps = per_step[1]
    assert ours == dp.num_buckets == ddps == 1, (per_step, dp.num_buckets)
    assert out["grad_ddp"] < 1e-6, f"grads differ from DDP by {out['grad_ddp']:.3e}"
    assert dp.require_backward_grad_sync is True, "the flag does not read back"


# 6 x (256 KiB weight + 1 KiB bias), packed greedily from the last layer (the order
# gradients arrive): default: 1 MiB first bucket (4 layers), then 25 MiB (2);
# explicit 0.3 MiB everywhere: 2 layers each; list [0.6, 0.3]: 3 layers, then 2, then
# the leftover. name -> (kwargs, all-reduces per step).
BUCKET_CAPS: dict[str, tuple[dict[str, Any], int]] = {
    "default": ({}, 2),
    "explicit": ({"bucket_cap_mb": 0.3}, 3),
    "list": ({"bucket_cap_mb_list": [0.6, 0.3]}, 3),
}


def bucket_caps(caps: str) -> None:
    """Bucket counts as documented, and torch DDP's in its second step (after the
    first-step rebuild, which packs in gradient-ready order)."""
    kwargs, expected = BUCKET_CAPS[caps]
    torch.manual_seed(0)
    # 6 x 256 KiB weights: more than the 1 MiB small first bucket.
    big = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
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
    diff = max_abs_diff(named_grads(dp), named_grads(ddp))
    assert diff < 1e-6, f"grads differ from DDP by {diff:.3e}"
    ours = log.count("all_reduce")
    assert ours == expected, f"{ours} all-reduces, expected {expected}"
    assert ours == len(calls), f"{ours} all-reduces, torch DDP {len(calls)}"


def _singleton_group_and_mesh() -> tuple[dist.ProcessGroup, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    return singles[rank], mesh


def process_group_and_device_mesh_decide_who_averages() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, mesh = _singleton_group_and_mesh()
    model = make_mlp()
    x, y = global_batch(0, world)
    local_ref = copy.deepcopy(model)
    F.mse_loss(local_ref(local(x, rank, world)), local(y, rank, world)).backward()
    alone = cadence.DataParallel(copy.deepcopy(model), process_group=mine)
    _step(alone, 0)
    # A singleton group: local gradients.
    diff = max_abs_diff(strip(named_grads(alone)), named_grads(local_ref))
    assert diff < 1e-7, f"a singleton group's grads differ from local ones by {diff:.3e}"
    meshed = cadence.DataParallel(copy.deepcopy(model), device_mesh=mesh)
    _step(meshed, 0)
    world_ddp = DDP(copy.deepcopy(model))
    _step(world_ddp, 0)
    diff = max_abs_diff(named_grads(meshed), named_grads(world_ddp))
    assert diff < 1e-6, f"device_mesh grads differ from DDP by {diff:.3e}"
    assert alone.process_group is mine, "process_group does not read back"


def process_group_and_device_mesh_together_are_refused() -> None:
    mine, mesh = _singleton_group_and_mesh()
    assert_raises(
        lambda: cadence.DataParallel(make_mlp(), process_group=mine, device_mesh=mesh),
        "process_group and device_mesh",
        "Pass one",
    )


def group_and_process_group_together_are_refused() -> None:
    mine, _ = _singleton_group_and_mesh()
    assert_raises(
        lambda: cadence.DataParallel(make_mlp(), group=mine, process_group=mine),
        "group and process_group",
    )


def _mp(**kwargs: Any) -> Any:
    from torch.nn.parallel.distributed import _MixedPrecision

    return _MixedPrecision(**kwargs)


def set_static_graph_with_a_window_pending_is_refused() -> None:
    dp = cadence.DataParallel(make_mlp())
    dp.require_manual_backward_finalization = True
    _step(dp, 0)
    assert_raises(dp._set_static_graph, "_set_static_graph()", "between steps")
    dp.finalize_backward()


def a_module_with_nothing_to_reduce_is_refused_as_ddp_refuses_it() -> None:
    """No parameter that requires grad (none at all, all frozen, all ignored): refused
    before any collective with a RuntimeError, as torch DDP, naming the cause."""
    from cadence.data_parallel import NothingToReduceError

    frozen = make_mlp().requires_grad_(False)
    ignored = make_mlp()
    ignored._ddp_params_and_buffers_to_ignore = [n for n, _ in ignored.named_parameters()]
    for module, counts in ((nn.Module(), "(0 parameter(s), 0 ignored)"),
                           (frozen, "(10 parameter(s), 0 ignored)"),
                           (ignored, "(10 parameter(s), 10 ignored)")):  # fmt: skip
        err = assert_raises(
            lambda m=module: cadence.DataParallel(m),
            "has no parameter that requires grad",
            counts,
            "nothing to reduce",
            kind=NothingToReduceError,
        )
        assert isinstance(err, RuntimeError) and isinstance(err, ValueError), type(err).__mro__
    # torch's DDP refuses the same module with the same builtin type.
    assert_raises(lambda: DDP(nn.Module()), "doesn't have any parameter", kind=RuntimeError)


def devices_none_empty_and_dim_as_ddp_accept() -> None:
    dp = cadence.DataParallel(make_mlp(), [], None, 1)
    assert dp.device_ids is None, f"device_ids {dp.device_ids!r}"


# Constructor arguments DDP's rules refuse (on a CPU module): name -> (kwargs, message
# fragments). Each error names the fix.
ARGUMENT_ERRORS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "cpu_device_ids": (lambda: {"device_ids": [0]}, ("device_ids=[0]", "model.to(local_rank)")),
    "two_device_ids": (lambda: {"device_ids": [0, 1]}, ("several devices",)),
    "output_device_alone": (lambda: {"output_device": 0}, ("needs device_ids",)),
    "dim_type": (lambda: {"dim": "0"}, ("dim must be an int",)),
    "delay_wrong_param": (
        lambda: {"delay_all_reduce_named_params": [("0.weight", nn.Parameter(torch.ones(1)))]},
        ("delay_all_reduce_named_params names '0.weight'",),
    ),
    "hook_without_delay": (
        lambda: {"param_to_hook_all_reduce": nn.Parameter(torch.ones(1))},
        ("needs delay_all_reduce_named_params",),
    ),
    "caps_list_and_first": (
        lambda: {"bucket_cap_mb_list": [1.0], "first_bucket_cap_mb": 0.5},
        ("drop first_bucket_cap_mb",),
    ),
    "negative_cap": (lambda: {"bucket_cap_mb": -1}, ("must be positive",)),
    "reduce_dtype_disagree": (
        lambda: {
            "mixed_precision": _mp(reduce_dtype=torch.bfloat16),
            "reduce_dtype": torch.float16,
        },
        ("disagree",),
    ),
    "mesh_2d": (
        lambda: {
            "device_mesh": torch.distributed.device_mesh.init_device_mesh(
                "cpu", (1, dist.get_world_size())
            )
        },
        ("device_mesh must be 1-D",),
    ),
    "mp_param_dtype": (
        lambda: {"mixed_precision": _mp(param_dtype=torch.bfloat16)},
        ("mixed_precision.param_dtype", "torch.autocast"),
    ),
    "skip_needs_find_unused": (
        lambda: {"skip_all_reduce_unused_params": True},
        ("find_unused_parameters=True",),
    ),
}


def argument_error(case: str) -> None:
    kwargs, fragments = ARGUMENT_ERRORS[case]
    assert_raises(lambda: cadence.DataParallel(make_mlp(), **kwargs()), *fragments)


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


def buffer_sync_arguments() -> None:
    """init_sync, broadcast_buffers vs forward_sync_buffers, require_forward_param_sync."""
    rank = dist.get_rank()
    x = torch.randn(2, WIDTH)
    log = cadence.EventLog()
    # broadcast_buffers=False (DDP's deprecated meaning): buffers skipped at init too.
    dp = cadence.DataParallel(_WithBuffer(), broadcast_buffers=False, event_log=log)
    spread = _spread(dp.module.stat)
    assert spread == 1.0, f"broadcast_buffers=False: spread {spread} after init"
    # forward_sync_buffers=False: synced at init, not at forward.
    dp = cadence.DataParallel(_WithBuffer(), forward_sync_buffers=False, event_log=log)
    spread = _spread(dp.module.stat)
    assert spread == 0.0, f"forward_sync_buffers=False: spread {spread} after init"
    dp.module.stat.fill_(rank)
    log.clear()
    dp(x)
    assert log.count("broadcast") == 0, f"forward_sync_buffers=False: {log.counts()}"
    # Default: broadcast at forward, unless require_forward_param_sync is off.
    dp = cadence.DataParallel(_WithBuffer(), event_log=log)
    dp.module.stat.fill_(rank)
    dp.require_forward_param_sync = False
    log.clear()
    dp(x)
    spread = _spread(dp.module.stat)
    assert log.count("broadcast") == 0, f"require_forward_param_sync=False: {log.counts()}"
    assert spread == 1.0, f"require_forward_param_sync=False: spread {spread}"
    dp.require_forward_param_sync = True
    dp(x)
    spread = _spread(dp.module.stat)
    assert log.count("broadcast") == 1, f"require_forward_param_sync=True: {log.counts()}"
    assert spread == 0.0, f"require_forward_param_sync=True: spread {spread}"
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
    assert pattern["ddp"] == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0], pattern
    assert pattern["cadence"] == pattern["ddp"], pattern
    # init_sync=False: rank-dependent parameters stay rank-dependent.
    torch.manual_seed(rank)
    dp = cadence.DataParallel(nn.Linear(WIDTH, 1), init_sync=False, event_log=log)
    spread = _spread(dp.module.weight)
    assert spread > 0, "init_sync=False: the parameters were synced"


def ddp_ignore_list_is_neither_reduced_nor_broadcast() -> None:
    """``_ddp_params_and_buffers_to_ignore``: neither reduced nor broadcast."""
    rank = dist.get_rank()
    m = _WithBuffer()
    DDP._set_params_and_buffers_to_ignore_for_model(m, ["other.weight", "other.bias", "private"])
    with torch.no_grad():
        m.other.weight.fill_(rank)
    dp = cadence.DataParallel(m)
    spreads = {
        "ignored_param": _spread(dp.module.other.weight),
        "ignored_buffer": _spread(dp.module.private),
    }
    xl = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(rank))
    dp(xl).sum().backward()
    spreads["ignored_grad"] = _spread(dp.module.other.weight.grad)
    spreads["reduced_grad"] = _spread(dp.module.lin.weight.grad)
    assert spreads["ignored_param"] == 1.0, spreads  # not broadcast at init
    assert spreads["ignored_buffer"] == 1.0, spreads
    assert spreads["ignored_grad"] > 0, spreads  # not reduced
    assert spreads["reduced_grad"] == 0.0, spreads


def delayed_all_reduce_is_launched_last() -> None:
    """delay_all_reduce_named_params: one regular bucket plus the delayed one, launched
    last with exactly those parameters."""
    model = make_mlp()
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
    diff = max_abs_diff(named_grads(dp), named_grads(ddp))
    assert diff < 1e-6, f"grads differ from DDP by {diff:.3e}"
    assert dp.num_buckets == len(events) == 2, (dp.num_buckets, len(events))
    delayed_numel = sum(p.numel() for _, p in delayed)
    assert events[-1].numel == delayed_numel, (events[-1].numel, delayed_numel)


def ddp_mixed_precision_reduce_dtype_is_the_wire_dtype() -> None:
    from torch.nn.parallel.distributed import _MixedPrecision

    log = cadence.EventLog()
    dp = cadence.DataParallel(
        make_mlp(), mixed_precision=_MixedPrecision(reduce_dtype=torch.bfloat16), event_log=log
    )
    log.clear()
    _step(dp, 0)
    wire = sorted({e.dtype for e in log.collectives("all_reduce")})
    assert wire == ["bfloat16"], wire


def check_reduction_warns_deprecated() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cadence.DataParallel(make_mlp(), check_reduction=True)
    categories = [w.category.__name__ for w in caught]
    assert any(issubclass(w.category, FutureWarning) for w in caught), categories


def torch_comm_hook_runs_unchanged(hook: str) -> None:
    fn = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}
    model = make_mlp()
    dp = cadence.DataParallel(copy.deepcopy(model))
    dp.register_comm_hook(None, fn[hook])
    ddp = DDP(copy.deepcopy(model))
    ddp.register_comm_hook(None, fn[hook])
    for w in (dp, ddp):
        _step(w, 0)
    diff = max_abs_diff(named_grads(dp), named_grads(ddp))
    assert diff < 1e-6, f"grads differ from DDP by {diff:.3e}"


def set_static_graph_handles_a_layer_checkpointed_twice() -> None:
    from tests.data_parallel.bodies_timing import _Twice

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
    diff = max_abs_diff(strip(named_grads(dp)), named_grads(ref))
    assert diff < 1e-6, f"grads differ from the reference by {diff:.3e}"
    assert dp.static_graph is True, "static_graph does not read back"


def fsdp2_verbs_switch_wrappers_with_one_line() -> None:
    """FSDP2's verbs, so a script switches wrappers with one line."""
    log = cadence.EventLog()
    dp = cadence.DataParallel(make_mlp(), event_log=log)
    dp.set_reshard_after_forward(True)
    dp.set_reshard_after_backward(False)
    for micro in range(3):
        dp.set_is_last_backward(micro == 2)
        dp.set_requires_gradient_sync(micro == 2)
        _step(dp, 0, micro)
    assert log.count("all_reduce") == 1, log.counts()


SCENARIOS = [
    *scenarios(require_backward_grad_sync_is_honoured),
    *cases(bucket_caps, "caps", list(BUCKET_CAPS)),
    *scenarios(
        process_group_and_device_mesh_decide_who_averages,
        process_group_and_device_mesh_together_are_refused,
        group_and_process_group_together_are_refused,
    ),
    *cases(argument_error, "case", list(ARGUMENT_ERRORS)),
    *scenarios(
        set_static_graph_with_a_window_pending_is_refused,
        a_module_with_nothing_to_reduce_is_refused_as_ddp_refuses_it,
        devices_none_empty_and_dim_as_ddp_accept,
        buffer_sync_arguments,
        ddp_ignore_list_is_neither_reduced_nor_broadcast,
        delayed_all_reduce_is_launched_last,
        ddp_mixed_precision_reduce_dtype_is_the_wire_dtype,
        check_reduction_warns_deprecated,
    ),
    *cases(torch_comm_hook_runs_unchanged, "hook", ["allreduce", "fp16"]),
    *scenarios(
        set_static_graph_handles_a_layer_checkpointed_twice,
        fsdp2_verbs_switch_wrappers_with_one_line,
    ),
]
