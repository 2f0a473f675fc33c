"""One fully_shard unit: its flat shard, its unsharded buffer, one all-gather, one reduce-scatter.

See [Note: cadence FSDP tensors] in ``_param.py`` for the layouts.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from cadence._groups.dp_layout import DataParallelLayout
from cadence.comm import CollectiveAlgorithms, Comm, CommWork, EventLog, phase
from cadence.errors import CadenceValueError
from cadence.fsdp._api import MixedPrecisionPolicy
from cadence.fsdp._errors import FullyShardError
from cadence.fsdp._grad_hooks import run_post_accumulate_grad_hooks
from cadence.fsdp._materialize import plan_reseat, replaced, seat
from cadence.fsdp._mp_rules import (
    grad_dtype_override,
    set_unsharded_grad_dtype,
    unsharded_grad_dtype,
)
from cadence.fsdp._param import ParamInfo, make_layout, make_sharded_param
from cadence.fsdp._streams import StreamSet

__all__ = ["AllGatherState", "PendingReduction", "ShardedState", "Unit"]


class ShardedState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gather issued, not yet copied out
    UNSHARDED = "unsharded"


class AllGatherState(NamedTuple):
    work: CommWork
    output: torch.Tensor  # (W*S,) rank-major, param dtype
    input: torch.Tensor  # (S,) kept alive while gloo reads it


class PendingReduction:
    """One unit's reduce-scatter (and HSDP all-reduce) in flight; owns its buffers."""

    __slots__ = ("ar_work", "held", "input_nbytes", "rs_output", "rs_work", "unit", "used")

    def __init__(
        self,
        unit: Unit,
        input_nbytes: int,
        rs_output: torch.Tensor,
        rs_work: CommWork,
        used: list[bool] | None = None,
    ) -> None:
        self.unit = unit
        # The (W, S) input itself is owned by the work, not held here: see
        # [Note: who keeps a reduce-scatter input alive] in cadence/fsdp/_root_runtime.py.
        self.input_nbytes = input_nbytes
        self.rs_output = rs_output  # (S,) reduce dtype
        self.rs_work = rs_work
        self.ar_work: CommWork | None = None
        # HSDP with set_requires_all_reduce(False): the output went into the unit's
        # partial_reduce, to be all-reduced later; nothing to write into .grad now.
        self.held = False
        # Per parameter: whether this rank's backwards gave it a gradient (None: assume
        # all did); see [Note: parameters without a gradient].
        self.used = used

    @property
    def input_bytes(self) -> int:
        """Bytes of the input while the reduction is in flight (0 once retired)."""
        return self.input_nbytes


def _registered_param(info: ParamInfo) -> nn.Parameter:
    """The parameter as the module registered it, before the unit shards it."""
    module, name = info.registrations[0]
    p = module._parameters[name]
    assert p is not None
    return p


def _set_versions(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    torch._C._autograd._unsafe_set_version_counter(tuple(tensors), tuple(versions))


class Unit:
    """Per-module sharding state (FSDP2's FSDPParamGroup)."""

    def __init__(
        self,
        module: nn.Module,
        params: list[ParamInfo],
        *,
        layout: DataParallelLayout,
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: bool | None,
    ) -> None:
        # -- identity and policy --
        self.module = module
        self.params = params
        self.mp_policy = mp_policy
        self.shard_group = layout.shard_group
        self.replicate_group = layout.replicate_group
        self.mesh = layout.mesh
        self.placements = layout.placements
        self.device = layout.device
        self.world = layout.shard_size
        self.rank = torch.distributed.get_rank(layout.shard_group)
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise CadenceValueError(
                f"fully_shard({type(module).__name__}): parameters have mixed dtypes {dtypes}; "
                "one unit all-gathers one flat buffer, so cast them to one dtype first or wrap "
                "them in separate units."
            )
        self.orig_dtype = dtypes.pop() if dtypes else torch.float32
        # [Note: a parameter's grad_dtype] in _mp_rules.py; read before sharding replaces them.
        self.grad_dtype = grad_dtype_override(
            [(info.fqn, _registered_param(info)) for info in params], type(module).__name__
        )
        self.param_dtype, self.reduce_dtype, self.accum_dtype = mp_policy.resolve(
            self.orig_dtype, self.grad_dtype
        )
        # -- flags read late by the hooks (see [Note: flags are read late] in _root_runtime.py) --
        self.reshard_after_forward_arg = reshard_after_forward
        self.reshard_after_forward = (
            True if reshard_after_forward is None else reshard_after_forward
        )
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True  # HSDP: all-reduce shards over replicas
        self.partial_reduce: torch.Tensor | None = None  # (S,) reduced over shards only
        # -- comm, set when the root's fully_shard call builds the runtime --
        self.event_log: EventLog | None = None
        self.comm: Comm | None = None
        self.replicate_comm: Comm | None = None
        # Kept on the unit so a root's fully_shard (which rebuilds the runtime and its
        # Comms) keeps what a setter chose earlier; None: CollectiveAlgorithms().
        self.collective_algorithms: CollectiveAlgorithms | None = None
        self.streams = StreamSet(self.device)  # see [Note: streams and events]
        # Where this unit's module sits under its root, for messages (set by fully_shard).
        self.path = ""
        # -- sharded storage (on meta for a module built there: see [Note: meta-device init]) --
        self.shard_numel = make_layout(params, self.world, self.rank)
        fulls = [_registered_param(info) for info in params]
        meta = any(full.is_meta for full in fulls)
        self.flat_shard = torch.zeros(
            self.shard_numel, dtype=self.orig_dtype, device="meta" if meta else self.device
        )  # 1D
        with torch.no_grad():
            for info, full in zip(params, fulls):
                if not meta:
                    start = min(self.rank * info.chunk_rows, info.shape[0])
                    rows = full.detach().narrow(0, start, info.local_rows)
                    dst = self.flat_shard.narrow(0, info.offset, info.local_numel)
                    dst.copy_(rows.reshape(-1))
                info.sharded = make_sharded_param(info, self.flat_shard, self.mesh, self.placements)
                info.local = info.sharded._local_tensor  # type: ignore[attr-defined]  # a DTensor, typed as Parameter
                info.register(info.sharded)
        self._keep_grad_dtype()
        # -- unsharded storage: one buffer, freed by resizing its storage to 0 --
        self.unsharded_flat = torch.empty(
            self.world * self.shard_numel, dtype=self.param_dtype, device=self.device
        )  # 1D, parameter-major
        for info in params:
            view = self.unsharded_flat.narrow(0, self.world * info.offset, info.numel).view(
                info.shape
            )
            info.unsharded = nn.Parameter(view, requires_grad=info.requires_grad)
            # Where autograd accumulates this gradient: [Note: the default reduce dtype
            # follows the installed torch] in _mp_rules.py.
            set_unsharded_grad_dtype(info.unsharded, self.reduce_dtype)
        self._free_unsharded()
        self.state = ShardedState.SHARDED
        self.all_gather_state: AllGatherState | None = None
        self.stale = False  # see [Note: stale unsharded copies] in _root_runtime.py
        # precompile_module is tracing this unit's forward: see
        # [Note: precompiling a fully_shard forward] in _trace.py.
        self.tracing = False
        # -- gradients --
        self.accumulated: torch.Tensor | None = None  # (W, S) accum dtype, no-sync accumulation
        self.post_backward_done = False
        self.pre_backward_done = False
        self.hooks_fired = 0
        self.num_grad_params = sum(1 for p in params if p.requires_grad)
        # Per parameter: got a gradient since the last reduction was issued; see
        # [Note: parameters without a gradient].
        self.grads_seen = [False] * len(params)
        # requires_grad per parameter as last synced: see [Note: requires_grad after sharding].
        self.grad_flags = [p.requires_grad for p in params]
        # -- prefetch lists --
        self.forward_prefetch: list[Unit] | None = None
        self.backward_prefetch: list[Unit] | None = None

    # -- bookkeeping ----------------------------------------------------------

    @property
    def unsharded_bytes(self) -> int:
        return self.unsharded_flat.untyped_storage().nbytes()

    @property
    def accumulated_bytes(self) -> int:
        acc = self.accumulated
        return 0 if acc is None else acc.numel() * acc.element_size()

    @property
    def sharded_bytes(self) -> int:
        return self.flat_shard.numel() * self.flat_shard.element_size()

    # -- unshard / reshard ----------------------------------------------------

    def _free_unsharded(self) -> None:
        storage = self.unsharded_flat.untyped_storage()
        if storage.nbytes():
            storage.resize_(0)

    def _alloc_unsharded(self) -> None:
        storage = self.unsharded_flat.untyped_storage()
        nbytes = self.unsharded_flat.numel() * self.unsharded_flat.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    def unshard(self, *, async_op: bool) -> None:
        """Issue the all-gather (if needed); with ``async_op=False`` also finish it."""
        with phase("fsdp.unshard"):
            self._unshard(async_op=async_op)

    def _unshard(self, *, async_op: bool) -> None:
        if self.state is ShardedState.UNSHARDED and not self.stale:
            return
        if not self.params:
            # A unit that owns no parameters (a root over child units): nothing to
            # gather, so no collective, as FSDP2 (which builds no parameter group).
            self.state = ShardedState.UNSHARDED
            self.stale = False
            return
        if self.state is not ShardedState.UNSHARDING:
            assert self.comm is not None, "lazy init must run before unshard"
            self.refresh("before an all-gather")
            self.check_materialized("an all-gather (forward, backward or unshard())")
            with self.streams.issue("all_gather"):
                if self.param_dtype == self.orig_dtype:
                    inp = self.flat_shard
                    self.streams.used_by(inp, "all_gather")
                else:
                    inp = self.flat_shard.to(self.param_dtype)
                # [Note: a shard group of one]
                # With one rank in the shard group (world 1, or HSDP with dp_shard=1) the
                # shard is the whole parameter: gathering it, or reduce-scattering its
                # gradient, is a copy, so no collective is issued (FSDP2 issues none
                # either). HSDP's all-reduce over replicas still runs.
                if self.world == 1:
                    out, work = inp, CommWork(None)
                else:
                    out = torch.empty(
                        self.world * self.shard_numel, dtype=self.param_dtype, device=self.device
                    )
                    work = self.comm.all_gather_single(out, inp, async_op=True)
            self.all_gather_state = AllGatherState(work, out, inp)
            self.state = ShardedState.UNSHARDING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self.state is not ShardedState.UNSHARDING:
            return
        ag = self.all_gather_state
        assert ag is not None
        ag.work.wait()  # on NCCL: the current stream waits, the host does not
        self.streams.used_by(ag.output)
        self._alloc_unsharded()
        self._check_unsharded_views()
        src = ag.output.view(self.world, self.shard_numel)
        unsharded = [info.unsharded for info in self.params]
        # Autograd saved these parameters in forward; refilling their storage for the
        # backward re-gather must not look like an in-place edit, so keep the versions.
        versions = [t._version for t in unsharded]  # type: ignore[union-attr]  # set once the unit is built
        dsts = [
            self.unsharded_flat.narrow(
                0, self.world * info.offset, self.world * info.chunk_numel
            ).view(self.world, info.chunk_numel)
            for info in self.params
        ]
        with torch.no_grad():
            # One fused copy-out per all-gather (the chunks tile each rank's row of
            # ``src`` exactly), not one copy op per parameter.
            torch.split_with_sizes_copy(
                src, [info.chunk_numel for info in self.params], dim=1, out=dsts
            )
        _set_versions(unsharded, versions)  # type: ignore[arg-type]  # set once the unit is built
        self.all_gather_state = None
        for info in self.params:
            assert info.unsharded is not None
            info.register(info.unsharded)
        self.state = ShardedState.UNSHARDED
        self.stale = False

    def reshard(self) -> None:
        with phase("fsdp.reshard"):
            self._reshard()

    def _reshard(self) -> None:
        if self.state is ShardedState.UNSHARDING:
            # Finish the in-flight all-gather so the collective order stays identical on
            # every rank; its result is simply dropped.
            assert self.all_gather_state is not None
            self.all_gather_state.work.wait()
            self.all_gather_state = None
        for info in self.params:
            assert info.sharded is not None
            info.register(info.sharded)
        self._free_unsharded()
        self.state = ShardedState.SHARDED
        self.stale = False

    # -- parameters changed after sharding ---------------------------------------

    def name_of(self, info: ParamInfo) -> str:
        """``info``'s name under the root (what ``named_parameters()`` shows)."""
        return f"{self.path}.{info.fqn}" if self.path else info.fqn

    def refresh(self, what: str) -> None:
        """Adopt what replaced the sharded parameters: [Note: parameters replaced after sharding]."""
        registered = self.state is ShardedState.SHARDED
        if not replaced(self.params, sharded_registered=registered):
            return
        plan = plan_reseat(
            self.params,
            mesh=self.mesh,
            placements=self.placements,
            device=self.device,
            rank=self.rank,
            sharded_registered=registered,
            name_of=self.name_of,
            what=what,
        )
        self.flat_shard = seat(
            self.params,
            plan,
            self.flat_shard,
            mesh=self.mesh,
            placements=self.placements,
            device=self.device,
            sharded_registered=registered,
        )
        if plan.dtype != self.orig_dtype:
            self._retype(plan.dtype)
        self._keep_grad_dtype()

    def _keep_grad_dtype(self) -> None:
        """The sharded parameters keep the user's ``grad_dtype`` (new objects lose it)."""
        if self.grad_dtype is None:
            return
        for info in self.params:
            if info.requires_grad and info.sharded is not None:
                info.sharded.grad_dtype = self.grad_dtype

    def _retype(self, dtype: torch.dtype) -> None:
        """The parameters now have ``dtype`` (``model.to(dtype)``, ``double()``, ...).

        A ``grad_dtype`` the user set stays (as FSDP2: an override cannot be unset).
        """
        self.orig_dtype = dtype
        self.param_dtype, self.reduce_dtype, self.accum_dtype = self.mp_policy.resolve(
            dtype, self.grad_dtype
        )
        for info in self.params:  # the reduce dtype follows the new dtype (torch >= 2.15)
            assert info.unsharded is not None
            set_unsharded_grad_dtype(info.unsharded, self.reduce_dtype)
        if self.unsharded_flat.dtype == self.param_dtype:
            return
        self.unsharded_flat = torch.empty(
            self.world * self.shard_numel, dtype=self.param_dtype, device=self.device
        )
        for info in self.params:
            assert info.unsharded is not None
            # ``.data`` keeps the object, and with it the gradient hook and the
            # identity a compiled forward guards on.
            info.unsharded.data = self.unsharded_flat.narrow(
                0, self.world * info.offset, info.numel
            ).view(info.shape)
        self._free_unsharded()

    def check_materialized(self, what: str) -> None:
        if self.flat_shard.is_meta:
            where = f"unit {self.path!r}" if self.path else "the root unit"
            raise FullyShardError(
                f"{what}: the parameters of {where} are still on the meta device. Fix: after "
                f"fully_shard, materialize them with model.to_empty(device={self.device.type!r}) "
                "and initialise them (reset_parameters() on each module, or your "
                "init_weights()), or load them with load_state_dict(sd, assign=True)."
            )

    def _check_unsharded_views(self) -> None:
        """The unsharded parameters still view the all-gather's destination (one read each)."""
        base = self.unsharded_flat.data_ptr()
        stride = self.world * self.unsharded_flat.element_size()
        for info in self.params:
            p = info.unsharded
            assert p is not None
            if info.numel and p.data_ptr() != base + info.offset * stride:
                raise FullyShardError(
                    f"parameter {self.name_of(info)!r} was replaced while its unit was "
                    "unsharded (by to()/to_empty()/_apply() on a submodule of the unit?), so "
                    "all-gathered values would no longer reach it. Fix: call such methods on "
                    "the fully_shard module itself, which reshards first, or between steps."
                )

    # [Note: requires_grad after sharding]
    # Autograd sees the unsharded parameters, but users freeze and unfreeze the ones
    # they hold: the sharded DTensors, or the unsharded ones while a unit is unsharded
    # (``parameters()`` returns those then). Each forward of a unit first carries a
    # flag changed on either side to the other (the side that differs from what the
    # unit recorded wins), so a frozen parameter gets no gradient (its ``.grad`` stays
    # None, as with FSDP2 and a plain module) and an unfrozen one is gathered, reduced
    # and stepped. Every unsharded parameter carries the post-accumulate hook from the
    # start, frozen ones included, so unfreezing needs no new hook; the number of
    # gradients the unit waits for is recounted at the same time.

    def register_grad_hooks(self, hook: Callable[[torch.Tensor], None]) -> None:
        """Hook every unsharded parameter; see [Note: requires_grad after sharding]."""
        for info in self.params:
            p = info.unsharded
            assert p is not None
            frozen = not p.requires_grad
            if frozen:
                p.requires_grad_(True)  # torch hooks only tensors that require grad
            p.register_post_accumulate_grad_hook(hook)
            if frozen:
                p.requires_grad_(False)

    def sync_requires_grad(self) -> None:
        """See [Note: requires_grad after sharding]. Reads two flags per parameter."""
        sharded = [info.sharded.requires_grad for info in self.params]  # type: ignore[union-attr]  # set once the unit is built
        unsharded = [info.unsharded.requires_grad for info in self.params]  # type: ignore[union-attr]  # set once the unit is built
        if sharded == unsharded == self.grad_flags:
            return
        for info, s_flag, u_flag in zip(self.params, sharded, unsharded):
            flag = s_flag if s_flag != info.requires_grad else u_flag
            if flag != info.requires_grad or s_flag != flag or u_flag != flag:
                info.requires_grad = flag
                info.sharded.requires_grad_(flag)  # type: ignore[union-attr]  # set once the unit is built
                info.unsharded.requires_grad_(flag)  # type: ignore[union-attr]  # set once the unit is built
        self.grad_flags = [info.requires_grad for info in self.params]
        self.num_grad_params = sum(self.grad_flags)

    # -- gradients --------------------------------------------------------------

    def take_unsharded_grads(self) -> list[torch.Tensor] | None:
        """The unsharded grads of this backward (zeros where unused), cleared from the params."""
        grads: list[torch.Tensor] = []
        any_grad = False
        for i, info in enumerate(self.params):
            p = info.unsharded
            assert p is not None
            g = p.grad
            p.grad = None
            if g is None:
                # The dtype autograd gives the others: _chunk_cat takes one dtype.
                dtype = unsharded_grad_dtype(self.param_dtype, self.reduce_dtype)
                g = torch.zeros(info.shape, dtype=dtype, device=self.device)
            else:
                any_grad = True
                self.grads_seen[i] = True
            grads.append(g)
        return grads if any_grad else None

    def take_grads_seen(self) -> list[bool]:
        """Which parameters got a gradient since the last call (the reduction's ``used``)."""
        seen, self.grads_seen = self.grads_seen, [False] * len(self.params)
        return seen

    def chunk_cat(self, grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(self.world, self.shard_numel, dtype=dtype, device=self.device)
        torch._chunk_cat(grads, dim=0, num_chunks=self.world, out=out)
        return out  # (W, S)

    def accumulate(self, grads: list[torch.Tensor]) -> None:
        """No-sync: add this backward's grads into the unsharded accumulation buffer."""
        if self.accumulated is None:
            self.accumulated = self.chunk_cat(grads, self.accum_dtype)
        else:
            self.accumulated += self.chunk_cat(grads, self.accum_dtype)

    def reduce_input(self, grads: list[torch.Tensor] | None) -> torch.Tensor | None:
        """The (W, S) reduce-scatter input: this backward's grads plus any accumulation."""
        acc, self.accumulated = self.accumulated, None
        if grads is None:
            return None if acc is None else acc.to(self.reduce_dtype)
        rs_in = self.chunk_cat(grads, self.reduce_dtype)
        if acc is not None:
            rs_in += acc
        return rs_in

    # [Note: parameters without a gradient]
    # One reduce-scatter carries the whole unit, so a parameter that got no gradient on
    # this rank (an unused output or branch) is reduced as zeros. FSDP2 reduces only the
    # parameters with a gradient and leaves the others' ``.grad`` as it was (None after
    # ``zero_grad()``), and optimizers treat None and zeros differently (Adam moves a
    # parameter with a zero gradient through its momentum). So a parameter no backward
    # of this reduction reached keeps its ``.grad`` here too, unless its reduced rows are
    # non-zero: then another rank used it (FSDP2 assumes every rank uses the same
    # parameters and fails otherwise), and the average is written as usual. The check
    # reads one chunk per such parameter (a host sync on CUDA), only when a parameter
    # had no local gradient.

    def write_sharded_grads(self, rs_output: torch.Tensor, used: list[bool] | None = None) -> None:
        """View-out: the reduced (S,) output becomes (or is added to) each sharded ``.grad``.

        ``used``: per parameter, whether this rank's backwards gave it a gradient; see
        [Note: parameters without a gradient]. None: all did.
        """
        self.streams.used_by(rs_output)  # allocated on the reduce-scatter stream
        dtype = self.grad_dtype or self.orig_dtype  # [Note: a parameter's grad_dtype]
        out = rs_output if rs_output.dtype == dtype else rs_output.to(dtype)
        for i, info in enumerate(self.params):
            if not info.requires_grad:
                continue
            p = info.sharded
            assert p is not None
            local = out.narrow(0, info.offset, info.local_numel).view(info.local_shape())
            if used is not None and not used[i] and not bool(local.any()):
                continue  # no rank's backward reached it: .grad stays as it was
            if p.grad is None:
                p.grad = DTensor.from_local(
                    local,
                    self.mesh,
                    self.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
            else:
                # Reduce-every-microbatch mode: accumulate in the sharded grad.
                p.grad._local_tensor.add_(local)  # type: ignore[attr-defined]  # a DTensor grad; torch types .grad as Tensor
            # The user's hooks on the sharded parameter, now that its reduced gradient is
            # written: [Note: hooks on sharded parameters] in _grad_hooks.py.
            run_post_accumulate_grad_hooks(p)
