"""``cadence.fully_shard``: the entry point and the methods of a fully sharded module."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.hooks import RemovableHandle

from cadence._grad_timing import autograd as _autograd
from cadence._grad_timing.timing import check_split_part, refuse_inside_backward
from cadence._groups.dp_layout import DataParallelGroup, DataParallelLayout
from cadence._groups.exchange import check_algorithms
from cadence._modules.conversions import conversion_name, conversion_target
from cadence.comm import CollectiveAlgorithms, EventLog, ReductionHandle
from cadence.errors import CadenceValueError
from cadence.fsdp._api import MixedPrecisionPolicy, check_fully_shard_args, to_mp_policy
from cadence.fsdp._cross_load import adopt_state_dict
from cadence.fsdp._errors import FullyShardError
from cadence.fsdp._materialize import check_param_devices
from cadence.fsdp._module_checks import check_contiguous, check_module, refuse_deepcopy
from cadence.fsdp._overlap import OverlapOptimizer
from cadence.fsdp._param import ParamInfo, collect_params, picklable_shards_hook
from cadence.fsdp._root_runtime import RootRuntime
from cadence.fsdp._ties import claim
from cadence.fsdp._unit import ShardedState, Unit

__all__ = ["FullyShardedModule", "UnshardHandle", "fully_shard"]

_CLASS_CACHE: dict[type, type] = {}
_PREFIX = "FullyShard["


def _long_name(cls: type) -> str:
    module = cls.__module__.replace(".", "/")
    return f"{_PREFIX}{module}:{cls.__qualname__.replace('.', '/')}]"


def _fully_shard_class(cls: type) -> type:
    """The ``FullyShard<Cls>`` class, created once and findable by name.

    [Note: findable FullyShard classes]
    fully_shard swaps a module's class for a dynamic subclass. Anything that
    pickles that class by reference (torch.compile's serialized guards, which
    precompile ships from the compiling rank to the others; ``torch.save`` of a
    whole module) looks it up as ``module.qualname`` in the receiving process. So
    each class is stored as an attribute of this module, under its ``__name__``
    (which is also its ``__qualname__``: torch's guard pickler replaces a module
    whose class has a differing qualname by a plain ``nn.Module``, which a type
    guard then rejects). The name is ``FullyShard<Cls>`` (as FSDP2's ``FSDP<Cls>``);
    a second wrapped class with the same ``__name__`` from another module gets the
    long form ``FullyShard[pkg/mod:Outer/Inner]`` (no dots: pickle walks dotted
    qualnames). The long form encodes the original class, so the module
    ``__getattr__`` below re-creates it in a process that has not wrapped such a
    module yet; the short form resolves in every process that wrapped the class,
    which in SPMD training is every rank.
    """
    new_cls = _CLASS_CACHE.get(cls)
    if new_cls is None:
        name = f"FullyShard{cls.__name__}"
        taken = globals().get(name)
        if taken is not None and taken.__mro__[2] is not cls:
            name = _long_name(cls)
        new_cls = type(name, (FullyShardedModule, cls), {"__module__": __name__})
        _CLASS_CACHE[cls] = new_cls
        globals()[name] = new_cls
    return new_cls


def __getattr__(name: str) -> Any:
    """Find (re-create) a long-form ``FullyShard[...]`` class by its attribute name."""
    if not (name.startswith(_PREFIX) and name.endswith("]")):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, qualname = name[len(_PREFIX) : -1].partition(":")
    target: Any = importlib.import_module(module.replace("/", "."))
    for part in qualname.split("/"):
        target = getattr(target, part)
    if not (isinstance(target, type) and issubclass(target, nn.Module)):
        raise AttributeError(f"{name!r} does not name an nn.Module class")
    new_cls = _fully_shard_class(target)
    if new_cls.__name__ != name:  # it was created under its short name
        globals()[name] = new_cls
    return new_cls


class UnshardHandle:
    """An in-flight ``unshard(async_op=True)``; ``wait()`` (idempotent) registers the params."""

    def __init__(self, unit: Unit, runtime: RootRuntime) -> None:
        self._unit = unit
        self._runtime = runtime

    def wait(self) -> None:
        self._unit.wait_unshard()
        self._runtime.note_unsharded()


class FullyShardedModule(nn.Module, OverlapOptimizer):
    """Mixed into the class of every module passed to `fully_shard` (first in the MRO)."""

    _cadence_unit: Unit
    # The runtime of this module's current root: replaced when a later fully_shard
    # call wraps an ancestor, so hooks look it up here at call time.
    _cadence_runtime: RootRuntime

    @property
    def _runtime(self) -> RootRuntime:
        return self._cadence_runtime

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # [Note: a slice of a sharded container is a plain container]
        # ``Sequential[:2]`` (and ModuleList slicing) builds ``type(self)(children)``.
        # That slice is no unit: it has no flat shard and no runtime, so a wrapped class
        # would fail on its first ``state_dict()`` or ``to()``. As FSDP2, a call with
        # arguments builds the original class. Pickle's argument-less ``__new__``
        # (``torch.save`` of a sharded module) still gets the wrapped class.
        if not (args or kwargs) or cls is FullyShardedModule:
            return super().__new__(cls)
        orig: Any = cls.__mro__[2]  # (FullyShard<Cls>, FullyShardedModule, Cls, ...)
        new: Any = orig.__new__
        obj = new(orig) if new is object.__new__ else new(orig, *args, **kwargs)
        obj.__init__(*args, **kwargs)
        return obj

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        refuse_deepcopy(self)  # as FSDP2: [Note: modules fully_shard refuses]

    def _units(self, recurse: bool) -> list[Unit]:
        if not recurse:
            return [self._cadence_unit]
        return [m._cadence_unit for m in self.modules() if isinstance(m, FullyShardedModule)]

    # -- timing verbs: cadence.GradientTiming, see [Note: one set of timing verbs] --

    def set_requires_gradient_sync(self, enabled: bool, *, recurse: bool = True) -> None:
        """Whether post-backward reduce-scatters (True) or accumulates unsharded (False)."""
        refuse_inside_backward(
            "set_requires_gradient_sync()",
            "a backward's sync decision holds for the whole backward.",
            FullyShardError,
        )
        for unit in self._units(recurse):
            unit.requires_gradient_sync = enabled

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag, so a DDP script's accumulation loop works unchanged.

        Setting it is ``set_requires_gradient_sync(flag)`` (recursive); reading it is
        True when every unit under this module reduces.
        """
        return all(u.requires_gradient_sync for u in self._units(recurse=True))

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, enabled: bool) -> None:
        self.set_requires_gradient_sync(enabled)

    def set_is_last_backward(self, is_last: bool) -> None:
        """False: the end of the coming backwards leaves their reductions in flight.

        As FSDP2: microbatches that reduce every backward need not wait each time; the
        backward after ``set_is_last_backward(True)`` (or ``finalize_backward()``)
        waits them all and writes ``.grad``. Sticky; the optimizer guard of
        `register_optimizer` raises while reductions are left in flight.
        """
        self._runtime.is_last_backward = bool(is_last)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False skips the all-reduce over replicas (reduce-scatter only) until True.

        See [Note: HSDP partial reductions] in ``_root_runtime.py``. Without replicas (1-D)
        there is no all-reduce, and the flag has no effect, as in FSDP2.
        """
        refuse_inside_backward(
            "set_requires_all_reduce()",
            "a backward's reduction plan holds for the whole backward.",
            FullyShardError,
        )
        for unit in self._units(recurse):
            unit.requires_all_reduce = bool(requires_all_reduce)

    def set_reshard_after_forward(self, enabled: bool, *, recurse: bool = True) -> None:
        for unit in self._units(recurse):
            unit.reshard_after_forward = enabled

    def set_reshard_after_backward(self, enabled: bool, *, recurse: bool = True) -> None:
        for unit in self._units(recurse):
            unit.reshard_after_backward = enabled

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Sticky: backward launches reductions; the caller completes them with finalize."""
        refuse_inside_backward(
            "set_manual_backward_finalization()",
            "the end-of-backward callback reads the mode.",
            FullyShardError,
        )
        self._runtime.manual_finalization = enabled

    @property
    def require_manual_backward_finalization(self) -> bool:
        return self._runtime.manual_finalization

    @require_manual_backward_finalization.setter
    def require_manual_backward_finalization(self, enabled: bool) -> None:
        self.set_manual_backward_finalization(enabled)

    @property
    def should_finalize_after_backward(self) -> bool:
        """True when the coming backward will leave reductions for finalize_backward()."""
        runtime = self._runtime
        return runtime.manual_finalization and any(u.requires_gradient_sync for u in runtime.units)

    def finalize_backward(self, *, async_op: bool = False) -> ReductionHandle | None:
        """Complete every pending reduction, following the current flags.

        Units in sync mode reduce what they accumulated in no-sync backwards; units
        already reduced in a syncing backward are only waited. Blocking, returns None;
        with ``async_op=True`` returns a `ReductionHandle` (already completed when
        nothing was pending) whose ``wait()`` writes the sharded ``.grad``. Inside
        backward: once every unit has launched its reduction (see
        [Note: finalize inside backward] in ``cadence/_grad_timing/timing.py``).
        """
        return self._runtime.finalize_backward(async_op=async_op)

    @contextlib.contextmanager
    def split_backward(self, part: str) -> Iterator[None]:
        """One part (``"input"`` or ``"weight"``) of a backward split in two.

        ``"input"``: units are unsharded for the backward inside but not finished (no
        post-backward, no reshard), since the weight part needs them. ``"weight"``: the
        autograd calls inside are the parameter half of one backward; each unit
        reshards and reduce-scatters (or accumulates) when all its parameters'
        gradients are ready, as in a full backward. See [Note: split backward parts]
        in ``cadence/_grad_timing/timing.py``.
        """
        runtime = self._runtime
        check_split_part(part, runtime.split_part, FullyShardError)
        runtime.begin_split_part(part)
        try:
            yield
        except BaseException:
            runtime.split_part = None  # a failed part ends nothing: reset_iter_state()
            raise
        runtime.end_split_part()

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Make ``optimizer.step()`` raise while reductions are pending (as DataParallel).

        Pending means a handle not yet waited, or (manual mode) reduce-scatters a
        backward launched that no ``finalize_backward()`` has written into ``.grad``.
        After a backward that raised, it raises until ``reset_iter_state()``.
        """
        runtime = self._runtime

        def _check(opt: Any, *_: Any) -> None:
            if runtime.overlap is not None and runtime.overlap.owns(opt):
                return  # an overlapped opt.step() finishes what is pending itself
            runtime.check_no_pending_handle("optimizer.step()")
            if not _autograd.in_backward():  # inside, the backward is simply running
                runtime.check_backward_finished("optimizer.step()")
            if runtime.inflight or runtime.retired:
                raise FullyShardError(
                    "optimizer.step() while gradient reductions launched by backward have "
                    "not been finalized, so .grad is not the reduced gradient yet. Fix: call "
                    "finalize_backward() (or wait its handle) before optimizer.step()."
                )

        return optimizer.register_step_pre_hook(_check)

    def set_max_inflight_reductions(self, n: int) -> None:
        """Reduce-scatter inputs alive at once during backward (default 1, as FSDP2).

        More lets manual/async finalization leave more reductions in flight for the
        caller to hide, at the cost of one (W, S) buffer per extra reduction. 0 waits
        each reduce-scatter at once (no overlap, FSDP2-on-CPU memory).
        """
        if n < 0:
            raise CadenceValueError(f"max in-flight reductions must be >= 0, got {n}")
        self._runtime.max_inflight_reductions = n

    def set_collective_algorithms(self, algorithms: CollectiveAlgorithms) -> None:
        """How every unit under this root runs its all-gathers and reduce-scatters on gloo.

        The default exchanges point to point where gloo's own collective is slow (see
        [Note: why cadence replaces some of gloo's collectives] in ``cadence/_groups/exchange.py``);
        ``CollectiveAlgorithms.native()`` calls gloo's collectives as FSDP2 does. NCCL
        always runs its own. Call it on every rank, between steps.
        """
        check_algorithms(algorithms, "fully_shard")
        refuse_inside_backward(
            "set_collective_algorithms()",
            "every rank must switch between the same two collectives.",
            FullyShardError,
        )
        for unit in self._runtime.units:
            unit.collective_algorithms = algorithms
            for comm in (unit.comm, unit.replicate_comm):
                if comm is not None:
                    comm.algorithms = algorithms

    # -- unshard / reshard (this module's unit only, as FSDP2) --------------------

    def unshard(self, *, async_op: bool = False) -> UnshardHandle | None:
        runtime = self._runtime
        runtime.check_no_pending_handle("unshard()")
        unit = self._cadence_unit
        unit.unshard(async_op=async_op)
        handle = UnshardHandle(unit, runtime)
        if not async_op:
            handle.wait()
            return None
        return handle

    def reshard(self) -> None:
        self._cadence_unit.reshard()

    def reset_iter_state(self) -> None:
        """Recover after an exception in forward/backward: drop in-flight state, reshard."""
        self._runtime.reset_iter_state()

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        self._cadence_unit.forward_prefetch = [_unit_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        self._cadence_unit.backward_prefetch = [_unit_of(m) for m in modules]

    def memory_stats(self) -> dict[str, int]:
        """Bytes per rank: shards, live/peak unsharded params, accumulation, in-flight RS."""
        return self._runtime.memory_stats()

    # -- state dict -------------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # Module.state_dict is overloaded
        """Sharded: every parameter is a DTensor ``Shard(0)`` (DCP-compatible)."""
        self._runtime.reshard_all_idle("state_dict()")
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Sharded entries (DTensors) copy into the shards; ``assign=True`` also takes full
        tensors and materializes a meta model. See [Note: parameters replaced after
        sharding] in ``_materialize.py``."""
        what = "load_state_dict(assign=True)" if assign else "load_state_dict()"
        self._runtime.reshard_all_idle(what)
        # Entries saved on another mesh (torch FSDP2's, say): rewrapped on this model's
        # when the layout agrees, else a clear error; [Note: per-rank state dicts across
        # meshes] in _cross_load.py.
        state_dict = adopt_state_dict(self, state_dict, what)
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        for unit in self._units(recurse=True):
            unit.refresh(what)
        return out

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """nn.Module's conversions (``to``, ``to_empty``, ``half``, ``cpu``, ...) on the shards.

        The units are resharded first (the sharded parameters are what gets
        converted), a device their shard group cannot use is refused before
        anything changes, and afterwards each unit re-seats its converted
        parameters in its flat shard: [Note: parameters replaced after sharding].
        """
        runtime = self._runtime
        if runtime.applying:  # a unit inside another's _apply: the outer one re-seats
            return super()._apply(fn, recurse=recurse)  # type: ignore[no-untyped-call]  # torch leaves Module._apply unannotated
        what = f"{conversion_name()}()"
        runtime.reshard_all_idle(what)
        units = self._units(recurse)
        for unit in units:
            target = conversion_target(fn, unit.orig_dtype, unit.flat_shard.device)
            if target is not None and target[1].type != "meta" and target[1] != unit.device:
                where = f"unit {unit.path!r}" if unit.path else "the root unit"
                raise FullyShardError(
                    f"{what} would move the shards of {where} to {target[1]}, but their shard "
                    f"group communicates on {unit.device}: fully_shard keeps a unit's shards "
                    f"and buffers on its group's device. Fix: keep the model on {unit.device} "
                    f"(to_empty(device={unit.device.type!r}) for a meta model), or build it on "
                    f"{target[1].type} and shard it over a process group of that device."
                )
        runtime.applying = True
        try:
            out = super()._apply(fn, recurse=recurse)  # type: ignore[no-untyped-call]  # torch leaves Module._apply unannotated
        finally:
            runtime.applying = False
        for unit in units:
            unit.refresh(what)
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Gathered plain tensors on every rank (collective: call it on every rank)."""
        self._runtime.reshard_all_idle("full_state_dict()")
        full: dict[int, torch.Tensor] = {}
        for unit in self._units(recurse=True):
            assert unit.comm is not None
            unit.check_materialized("full_state_dict()")
            out = torch.empty(
                unit.world * unit.shard_numel, dtype=unit.orig_dtype, device=unit.device
            )
            unit.comm.all_gather_single(out, unit.flat_shard)
            grid = out.view(unit.world, unit.shard_numel)
            for info in unit.params:
                block = grid.narrow(1, info.offset, info.chunk_numel).reshape(-1)
                full[id(info.sharded)] = block[: info.numel].view(info.shape).clone()
        sd = super().state_dict(keep_vars=True)
        return {k: full[id(v)] if id(v) in full else v.detach().clone() for k, v in sd.items()}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Load gathered tensors (``full_state_dict()`` or a single-process model).

        A model still on meta is materialized from them (each rank keeps its rows).
        """
        self._runtime.reshard_all_idle("load_full_state_dict()")
        current = super().state_dict(keep_vars=True)
        converted: dict[str, Any] = {}
        for key, value in state_dict.items():
            target = current.get(key)
            if isinstance(target, DTensor):
                shard_dim_rows = _local_rows(target)
                start, rows = shard_dim_rows
                local = value.detach().narrow(0, start, rows).to(target.dtype)
                converted[key] = DTensor.from_local(
                    local,
                    target.device_mesh,
                    target.placements,
                    run_check=False,
                    shape=target.shape,
                    stride=target.stride(),
                )
            else:
                converted[key] = value
        meta = any(unit.flat_shard.is_meta for unit in self._units(recurse=True))
        return self.load_state_dict(converted, strict=strict, assign=meta)


def _local_rows(target: DTensor) -> tuple[int, int]:
    local = target.to_local()
    mesh = target.device_mesh
    shard_mesh_dim = next(i for i, p in enumerate(target.placements) if isinstance(p, Shard))
    world = mesh.size(shard_mesh_dim)
    rank = mesh.get_local_rank(shard_mesh_dim)
    chunk = -(-target.shape[0] // world)
    return min(rank * chunk, target.shape[0]), local.shape[0]


def _check_placements(
    params: list[ParamInfo], shard_placement_fn: Callable[[nn.Parameter], Any] | None
) -> None:
    if shard_placement_fn is None:
        return
    for info in params:
        reg_module, reg_name = info.registrations[0]
        placement = shard_placement_fn(reg_module._parameters[reg_name])  # type: ignore[arg-type]  # a registered parameter, not None
        if placement is not None and placement != Shard(0):
            raise FullyShardError(
                f"fully_shard: shard_placement_fn gave {placement} for {info.fqn!r}; fully_shard "
                "shards every parameter on dim 0. Return None or Shard(0), or drop the function."
            )


def _unit_of(module: nn.Module) -> Unit:
    if not isinstance(module, FullyShardedModule):
        raise CadenceValueError(
            f"{type(module).__name__} is not a fully_shard module; prefetch lists name "
            "modules that fully_shard was applied to."
        )
    return module._cadence_unit


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy | Any | None = None,
    offload_policy: Any = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    group: DataParallelGroup = None,
    event_log: EventLog | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters (those not owned by nested units) on dim 0.

    Apply bottom-up: chosen submodules first, then the root. Returns ``module`` itself,
    whose class becomes ``FullyShard<Class>`` (names and state-dict keys unchanged).
    Takes torch FSDP2's ``fully_shard`` arguments (see [Note: FSDP2 arguments]).

    Args:
        mesh: FSDP2's spelling of ``group=`` with a DeviceMesh (1-D: shard; 2-D:
            (replicate, shard), HSDP). Pass one of ``mesh`` and ``group``.
        reshard_after_forward: free the unsharded parameters after forward (re-gathered
            for backward). ``None``: True except for the root.
        shard_placement_fn: FSDP2's per-parameter placement; only ``None`` /
            ``Shard(0)`` results are accepted (fully_shard shards on dim 0).
        mp_policy: a `MixedPrecisionPolicy`, cadence's or torch's.
        offload_policy: torch's ``OffloadPolicy()`` (no offload) is accepted;
            ``CPUOffloadPolicy`` is refused.
        ignored_params: parameters left alone: not sharded, not all-gathered, and
            their gradients are not reduced (as FSDP2).
        dp_mesh_dims: refused unless None (name the data-parallel submesh instead).
        group: the data-parallel group: None (the world), a ProcessGroup (shard over
            it), a `ParallelGroups` (shard over ``dp_shard``; HSDP when
            ``dp_replicate > 1``: all-reduce the shards over ``dp_replicate``) or a
            DeviceMesh (as ``mesh``). See [Note: the meaning of group=] in
            ``cadence/topology.py``; DataParallel reads it the same way.
        event_log: records every collective (the root's log is used by all units).
    """
    check_module(module)  # [Note: modules fully_shard refuses] in _module_checks.py
    if isinstance(module, FullyShardedModule):
        raise FullyShardError(
            f"fully_shard was already applied to {type(module).__name__}; apply it once."
        )
    check_fully_shard_args(
        mesh=mesh,
        group=group,
        reshard_after_forward=reshard_after_forward,
        dp_mesh_dims=dp_mesh_dims,
        offload_policy=offload_policy,
    )
    mp_policy = to_mp_policy(mp_policy)
    layout = DataParallelLayout.of(mesh if mesh is not None else group, who="fully_shard")
    params = collect_params(module, ignored={id(p) for p in ignored_params or ()})
    _check_placements(params, shard_placement_fn)
    check_param_devices(params, layout.device, type(module).__name__)
    originals = [reg[0]._parameters[reg[1]] for reg in (info.registrations[0] for info in params)]
    check_contiguous(
        [(info.fqn, p) for info, p in zip(params, originals, strict=True) if p is not None],
        type(module).__name__,
    )
    unit = _make_unit(module, params, layout, mp_policy, reshard_after_forward, event_log)
    # Later calls recognise these parameters: [Note: parameter identity across units].
    claim(unit, [p for p in originals if p is not None])
    _rebuild_root_runtime(module, unit, event_log)
    _install_hooks(module, unit)
    return module


def _make_unit(
    module: nn.Module,
    params: list[ParamInfo],
    layout: DataParallelLayout,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool | None,
    event_log: EventLog | None,
) -> Unit:
    """The module's own unit (its flat shard), and its class swapped: it is now a unit."""
    unit = Unit(
        module,
        params,
        layout=layout,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
    )
    unit.event_log = event_log
    module._cadence_unit = unit  # type: ignore[assignment]  # Module types attributes as Tensor | Module
    module.__class__ = _fully_shard_class(type(module))
    return unit


def _rebuild_root_runtime(module: nn.Module, unit: Unit, event_log: EventLog | None) -> None:
    """This call's module is the root until a later call wraps it: rebuild the runtime."""
    units = [m._cadence_unit for m in module.modules() if isinstance(m, FullyShardedModule)]
    inherited = [u.event_log for u in units if u.event_log is not None]
    log = event_log or (inherited[0] if inherited else None)
    runtime = RootRuntime(unit, units, log)
    paths = {id(m): name for name, m in module.named_modules()}
    for u in units:
        u.path = paths.get(id(u.module), "")
        if u.state is not ShardedState.SHARDED:
            u.reshard()
        u.module._cadence_runtime = runtime  # type: ignore[assignment]  # Module types attributes as Tensor | Module
        # None: nested units reshard, the root does not: its backward starts right where
        # its forward ends, so resharding it would only re-gather the same parameters at
        # once. An explicit value is honoured for the root too, as in FSDP2 2.13.
        arg = u.reshard_after_forward_arg
        u.reshard_after_forward = (u is not unit) if arg is None else arg


def _install_hooks(module: nn.Module, unit: Unit) -> None:
    """The hooks that drive a unit, each reading the runtime live: a later root replaces it."""
    module.register_state_dict_post_hook(picklable_shards_hook)
    wrapped = cast(FullyShardedModule, module)
    module.register_forward_pre_hook(
        lambda m, args, kwargs: wrapped._runtime.pre_forward(unit, args, kwargs),
        with_kwargs=True,
    )
    module.register_forward_hook(
        lambda m, args, output: wrapped._runtime.post_forward(unit, output)
    )
    unit.register_grad_hooks(lambda p: wrapped._runtime.post_accumulate(unit))
