"""The pipeline executor: runs this rank's lowered `Action` list, one handler per kind.

What it does, in order:
1. At construction: the lowered schedule must pass the simulator's `verify` (the
   runtime refuses one that does not, on every rank alike, before any
   communication); every rank votes on the one plan digest (`ChannelPlan.digest`)
   and creates its channel groups (``groups.py``), preconnected, before any step.
2. ``step(*inputs, target=..., losses=...)``: split into microbatches (an uneven
   batch raises here, before any communication), infer stage metadata on the
   first step if it was not given, then execute this rank's actions in order.
3. SEND/RECV go through ``cadence.Comm(channel group).isend/irecv``; LOCAL hands a
   tensor to another stage on the same rank without any P2P (the V turn).
4. On an error the rank's lowered schedule is raised with the failing action
   marked (``<-- ERROR HERE``), with its channel and sequence number.

Sends are waited at their WAIT_SEND or at the end of the step (their buffers are
kept alive until then); receives are waited just before the compute that
consumes them.

[Note: batched P2P]
With ``batch_p2p=True`` each run of consecutive SEND/RECV actions is posted at
its first action, as one ``batch_isend_irecv`` per communicator (NCCL posts a
batch as one group, which also lets a send and a receive with the same peer in
the shared channel mode progress together). Nothing moves across a compute
action, and within each communicator the ops keep program order (one op per
tensor of a multi-tensor boundary), so the FIFO pairing that `verify` proved is
unchanged: the receiver's buffers and the sender's works end up where the
single-op handlers would have put them. With per-edge channels a batch holds the
ops of one directed edge (torch requires one group per batch), so on gloo, which
does not coalesce, it is the same ops issued the same way.

[Note: the executor trusts the verified lists]
The runtime executes exactly the action lists that `verify` accepted, so the
properties the simulator proves are not re-checked per action: every RECV has its
SEND and is consumed, every compute finds its input in an earlier RECV or LOCAL,
and on each channel the i-th send meets the i-th receive (the sequence numbers
agree with program order). A forward-only run (`PipelineRuntime.eval`) drops every
gradient transfer on both ends of each channel, which keeps the remaining
activation transfers in the same relative order, so the FIFO pairing still holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from cadence.comm import Comm, CommWork, EventLog, phase
from cadence.pipeline.runtime.errors import (
    PipelineRuntimeError,
    PipelineStateError,
    PipelineUsageError,
)
from cadence.pipeline.runtime.grad_sync import StageGradSync, last_backwards, split_refusal
from cadence.pipeline.runtime.groups import ChannelMode, build_channel_groups
from cadence.pipeline.runtime.lookahead import check_lookahead, recv_plan
from cadence.pipeline.runtime.lookahead import p2p_runs as _p2p_runs
from cadence.pipeline.runtime.metadata import agree_metadata
from cadence.pipeline.runtime.microbatch import (
    LossPolicy,
    merge_microbatches,
    split_microbatches,
)
from cadence.pipeline.runtime.stage import Stage
from cadence.pipeline.runtime.tied import Tied, TiedParameters, Ties, TieSpec, resolve_ties
from cadence.pipeline.schedule.channels import CHANNEL_MODES, channel_plan
from cadence.pipeline.schedule.ir import Action, ActionKind, Payload, Schedule
from cadence.pipeline.schedule.sim import verify
from cadence.topology import ParallelGroups

__all__ = ["PipelineRuntime", "PipelineRuntimeError"]

# Kinds a forward-only step keeps (transfers are kept when they carry activations).
_FORWARD_KINDS = frozenset({ActionKind.F, ActionKind.UNSHARD, ActionKind.RESHARD})
_TRANSFERS = frozenset({ActionKind.SEND, ActionKind.RECV, ActionKind.LOCAL})
Tensors = tuple[torch.Tensor, ...]
_Losses = list[torch.Tensor] | None  # step(losses=...): receives the microbatch losses
_SendKey = tuple[int, int | None, Payload | None, int | None, int]  # see _send_key


class PipelineRuntime:
    """Execute a lowered pipeline schedule on this rank. Collective over the world.

    Usually built by `build_pipeline` (``build.py``) from a schedule name; this
    constructor takes a lowered `Schedule` (``lower(generate(...))``, a JSON/CSV
    file, or torch's lowered lists through ``complete_comms``).

    Args:
        schedule: the lowered schedule of *every* rank (the plan is global).
        stages: this rank's `Stage` objects, exactly the stages the
            schedule's placement gives this rank.
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage.
        groups: ``cadence.init(...)``'s result; its pp group is the pipeline.
            Default: the whole world is one pipeline.
        loss_reduction: ``"mean"`` (default, equal to one process on the full batch)
            or ``"sum"``; see `LossPolicy`.
        channel_mode: the communicators P2P runs on: ``"per_directed_edge"``
            (default: one per directed rank pair), ``"per_direction"`` (two per pp
            group, activations and gradients; what NCCL users who cap communicators
            want) or ``"shared"`` (the pp group). ``lower`` orders every generated
            schedule deadlock-free under all three, and `verify` checks the given
            schedule under the chosen one.
        event_log: records every P2P with its channel (``event.group == "pp0->1"``;
            ``"pp0->1/fwd"`` / ``"pp1->0/bwd"`` in ``per_direction`` mode),
            every LOCAL hand-off as a mark named ``"pp_local"``, each finished compute
            action as a mark ``"pp_compute"`` (``stage``, ``kind``, ``mb``), and
            REDUCE_GRAD / WAIT_REDUCE_GRAD as ``"pp_reduce_grad"`` /
            ``"pp_wait_reduce_grad"``, all in one order (``event.seq``).
        tied_parameters: ties across stages, each ``[(stage, parameter name in that
            stage's module), ...]``, e.g. ``[[(0, "embed.weight"), (3, "head.weight")]]``:
            after a syncing step every copy holds the sum of the copies' gradients.
            The same on every rank; see [Note: tied parameters across stages].
        batch_p2p: post each run of consecutive SEND/RECV actions as one
            ``batch_isend_irecv`` per communicator; see [Note: batched P2P].
        recv_lookahead: receives kept posted ahead of the list per channel (default:
            1 with ``per_directed_edge`` channels and no ``batch_p2p``, else 0); see
            [Note: receive lookahead] in ``lookahead.py``.
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Sequence[Stage],
        *,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        groups: ParallelGroups | None = None,
        loss_reduction: str = "mean",
        channel_mode: ChannelMode = "per_directed_edge",
        event_log: EventLog | None = None,
        tied_parameters: Sequence[TieSpec] = (),
        batch_p2p: bool = False,
        recv_lookahead: int | None = None,
    ) -> None:
        lookahead, pp_ranks = _check_arguments(
            schedule, channel_mode, batch_p2p, recv_lookahead, groups
        )
        # The gate: every rank verifies the same global schedule, so a bad one
        # raises on every rank here, before any process group exists.
        verify(schedule, mode=channel_mode)
        self.schedule = schedule
        self.plan = channel_plan(schedule, channel_mode)
        self.placement = schedule.placement
        self.num_stages = schedule.num_stages
        self.n_microbatches = schedule.meta.m
        self.loss_fn = loss_fn
        self.policy = LossPolicy(loss_reduction)  # type: ignore[arg-type]  # a str here; LossPolicy checks it
        self.event_log = event_log
        self.pp_ranks = pp_ranks
        self.pp_rank = pp_ranks.index(dist.get_rank())
        self.stages = {st.stage_index: st for st in stages}
        self.actions: tuple[Action, ...] = schedule.ranks[self.pp_rank]
        ties, tied, local_error = self._local_checks(tied_parameters)
        self._plan_stages()
        self._connect(groups, local_error, ties)
        # See [Note: tied parameters across stages] in tied.py.
        self.tied = TiedParameters(
            ties, tied, self.placement, self.channel_groups.all_pp_groups, event_log
        )
        self._route_actions()
        self._meta_ready = False  # every rank agrees the stage metadata at the first step
        self._plan_posting(batch_p2p, lookahead)

    # -- construction -----------------------------------------------------------

    def _local_checks(self, tied_parameters: Sequence[TieSpec]) -> tuple[Ties, Tied, str | None]:
        """Misuses only this rank can see, returned for the plan vote rather than raised."""
        # A local misuse is voted on with the plan (groups.py) rather than raised
        # here, so that the other ranks fail with it instead of hanging.
        self._sync = {s: StageGradSync(st.module) for s, st in self.stages.items()}
        modules = {s: st.module for s, st in self.stages.items()}
        ties, tied, tie_error = resolve_ties(tied_parameters, self.num_stages, modules)
        local_error = self._stage_mismatch() or tie_error
        return ties, tied, local_error or split_refusal(self.actions, self._sync)

    def _plan_stages(self) -> None:
        """What the action list asks of each local stage, derived once rather than per step."""
        self._last_backward = last_backwards(self.actions)
        for s in {
            a.stage for a in self.actions if a.kind in (ActionKind.UNSHARD, ActionKind.RESHARD)
        }:
            if s in self._sync:
                self._sync[s].take_placement()
        self._forward_actions = tuple(
            x for a in self.actions for x in (a.sub or (a,)) if _forward_only(x)
        )

    def _connect(self, groups: ParallelGroups | None, local_error: str | None, ties: Ties) -> None:
        """The plan vote and the channel communicators: the first collective of the runtime."""
        self._pp_comm = Comm(groups.pp if groups is not None else None, name="pp")
        # Collective over the world; raises PlanMismatchError before any group exists.
        self.channel_groups = build_channel_groups(
            self.plan,
            pp_ranks=self.pp_ranks,
            pp_group=groups.pp if groups is not None else None,
            event_log=self.event_log,
            local_error=local_error,
            agree=("tied_parameters", ties),
            pp_groups=groups.topology.groups_of("pp") if groups is not None else None,
        )

    def _route_actions(self) -> None:
        """Each transfer's communicator and each kind's handler, looked up once, not per step."""
        # The per-action route, derived once from the placement (validate_lowered
        # checked any channel an action states against it): the communicator of the
        # action's channel and payload, and the peer's rank in it.
        comms = self.channel_groups.comms(self.event_log)
        self._route = {
            a: comms[(self._channel(a), cast(Payload, a.payload))]  # a transfer has a payload
            for a in self.actions
            if a.kind in (ActionKind.SEND, ActionKind.RECV)
        }
        self._handlers: dict[ActionKind, Callable[[Action, int, _StepState], None]] = {
            ActionKind.F: self._forward,
            ActionKind.B: self._backward,
            ActionKind.I: self._backward,
            ActionKind.W: self._backward_weight,
            ActionKind.FB_OVERLAP: self._overlap,
            ActionKind.SEND: self._send,
            ActionKind.RECV: self._recv,
            ActionKind.LOCAL: self._local,
            ActionKind.WAIT_SEND: self._wait_send,
            ActionKind.BARRIER: self._barrier,
            ActionKind.REDUCE_GRAD: self._reduce_grad,
            ActionKind.WAIT_REDUCE_GRAD: self._wait_reduce_grad,
            ActionKind.UNSHARD: lambda a, i, st: self._sync[a.stage].unshard(),
            ActionKind.RESHARD: lambda a, i, st: self._sync[a.stage].reshard(),
        }

    def _plan_posting(self, batch_p2p: bool, lookahead: int) -> None:
        """When each transfer is posted (batched runs, receives ahead), for both action lists."""
        self.local_handoffs = 0  # lifetime count of LOCAL hand-offs (tests read it)
        self.batch_p2p = bool(batch_p2p)
        self.p2p_batches = 0  # lifetime count of batch_isend_irecv calls (tests read it)
        self._p2p_runs = (
            {id(acts): _p2p_runs(acts) for acts in (self.actions, self._forward_actions)}
            if self.batch_p2p
            else {}
        )
        # See [Note: receive lookahead] in lookahead.py.
        self.recv_lookahead = lookahead
        self._recv_plans = {
            id(acts): recv_plan(acts, lookahead, self._channel)
            for acts in (self.actions, self._forward_actions)
        }

    # -- validation -----------------------------------------------------------

    def _stage_mismatch(self) -> str | None:
        mine = set(self.schedule.stages_of(self.pp_rank))
        if set(self.stages) != mine:
            return (
                f"pipeline rank {self.pp_rank} was given stages {sorted(self.stages)} but the "
                f"schedule places stages {sorted(mine)} on it; build exactly those stages "
                f"on this rank (placement: stage -> rank {dict(enumerate(self.placement))})"
            )
        for st in self.stages.values():
            if st.num_stages != self.num_stages:
                return f"{st} says num_stages={st.num_stages}, the schedule has {self.num_stages}"
        return None

    def _channel(self, a: Action) -> tuple[int, int]:
        src, dst = (a.peer_stage, a.stage) if a.kind is ActionKind.RECV else (a.stage, a.peer_stage)
        return (self.placement[src], self.placement[dst])  # type: ignore[index]  # Action.__post_init__ sets a transfer's peer and payload; Optional on Action

    # -- public API -------------------------------------------------------------

    def step(
        self,
        *inputs: Any,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
        sync_gradients: bool = True,
    ) -> Any:
        """One training step over the whole batch (shaped like torch's ``step``).

        Args:
            inputs: the full batch for stage 0 (split along dim 0 here).
            target: the full-batch target for the loss on the last stage.
            losses: if given, receives the per-microbatch (unscaled) losses on the
                rank that holds the last stage.
            sync_gradients: False for an accumulation step: DP wrappers accumulate
                locally and no reduction is issued.

        Returns:
            The merged last-stage outputs on the rank that holds the last stage,
            else ``None``.
        """
        if not torch.is_grad_enabled():
            raise PipelineUsageError("step() under torch.no_grad(); use eval() for forward only")
        if self.loss_fn is None:
            raise PipelineUsageError(
                "a training step needs loss_fn=...; use eval() for forward only"
            )
        return self._run(self.actions, inputs, target, losses, backward=True, sync=sync_gradients)

    def eval(self, *inputs: Any, target: torch.Tensor | None = None, losses: _Losses = None) -> Any:
        """Forward only (no graph kept, no gradients): the F actions and their transfers."""
        with torch.no_grad():
            return self._run(
                self._forward_actions, inputs, target, losses, backward=False, sync=False
            )

    # -- step -------------------------------------------------------------------

    def _split(
        self, inputs: Sequence[Any], target: torch.Tensor | None
    ) -> tuple[list[tuple[Any, ...]], list[Any]]:
        # Validate whatever this rank was given, even the inputs it does not use:
        # with the usual SPMD call (same arguments everywhere) an uneven batch then
        # fails on *every* rank here, instead of on one rank while its peers wait.
        m = self.n_microbatches
        mbs = split_microbatches(inputs, m)
        targets = [t[0] for t in split_microbatches([target], m)] if target is not None else None
        last = self.num_stages - 1
        if last in self.stages and self.loss_fn is not None and targets is None:
            raise PipelineUsageError("step() needs target= for the loss on the last stage")
        return mbs, targets or [None] * m

    def _run(
        self,
        actions: Sequence[Action],
        inputs: Sequence[Any],
        target: torch.Tensor | None,
        losses: list[torch.Tensor] | None,
        *,
        backward: bool,
        sync: bool,
    ) -> Any:
        mbs, targets = self._split(inputs, target)
        if not self._meta_ready:
            agree_metadata(self.stages, self.placement, self.pp_rank, self._pp_comm, mbs[:1])
            self._meta_ready = True
        st = _StepState(mbs, targets, backward)
        for s in self._sync.values():
            s.begin_step(sync and backward)
        runs = self._p2p_runs.get(id(actions), {})
        plan = self._recv_plans.get(id(actions))
        posted: set[int] = set()
        for i, a in enumerate(actions):
            try:
                if plan is not None:
                    for j in plan.at_start if i == 0 else ():
                        self._post_recv(actions, j, posted, st)
                    if a.kind is ActionKind.RECV:
                        for j in plan.on_reach[i]:
                            self._post_recv(actions, j, posted, st)
                        continue
                run = runs.get(i)
                if run is not None:  # batched P2P: posted with the run's first action
                    if run:
                        self._post_batch(run, st)
                    continue
                with phase("pp.", a):
                    self._handlers[a.kind](a, i, st)
                if self.event_log is not None and a.is_compute:
                    for c in a.compute_parts():
                        self.event_log.mark("pp_compute", stage=c.stage, kind=c.kind.name, mb=c.mb)
            except Exception as e:
                for stage in self.stages.values():
                    stage.clear()
                raise PipelineRuntimeError(
                    self._report(actions, i, e), rank=self.pp_rank, index=i, action=a
                ) from e
        for works in st.sends.values():
            for w in works:
                w.wait()
        if backward:
            for s in self._sync.values():
                s.end_step()
            if sync and self.tied:
                self.tied.sum_grads()
        for stage in self.stages.values():
            stage.clear()
        if losses is not None and st.losses:
            losses.extend(st.losses[mb] for mb in sorted(st.losses))
        if st.outputs:
            return merge_microbatches([st.outputs[mb] for mb in sorted(st.outputs)])
        return None

    def _report(self, actions: Sequence[Action], index: int, exc: BaseException) -> str:
        lines = [
            f"pipeline rank {self.pp_rank} (global rank {dist.get_rank()}) failed at action "
            f"{index} ({actions[index]}): {type(exc).__name__}: {exc}",
            "lowered schedule of this rank:",
        ]
        for j, a in enumerate(actions):
            extra = ""
            if a.channel is not None:
                extra = f"  [channel {a.channel[0]}->{a.channel[1]} seq {a.seq}]"
            mark = "  <-- ERROR HERE" if j == index else ""
            lines.append(f"  {j:4d}  {a}{extra}{mark}")
        return "\n".join(lines)

    # -- handlers: compute ------------------------------------------------------

    def _take(self, st: _StepState, key: tuple[int, int, bool]) -> Tensors:
        if key in st.local:
            return st.local.pop(key)
        queue = st.recvs.get(key)
        if not queue:  # impossible for a verified schedule; name it if it happens
            raise PipelineStateError(f"stage {key[0]} microbatch {key[1]}: no input to consume")
        bufs, works = queue.pop(0)
        for w in works:
            w.wait()
        return bufs

    def _forward(self, a: Action, i: int, st: _StepState) -> None:
        stage = self.stages[a.stage]
        mb = a.mb
        assert mb is not None
        if stage.is_first:
            inputs, how = st.mbs[mb], "user input"
        else:
            how = "received" if (a.stage, mb, False) not in st.local else "local hand-off"
            inputs = self._take(st, (a.stage, mb, False))
        outs = stage.forward(mb, inputs, how=how)
        if stage.is_last:
            st.outputs[mb] = tuple(o.detach() for o in outs)
            if self.loss_fn is not None:
                loss = self.loss_fn(*outs, st.targets[mb])
                st.losses[mb] = loss.detach()
                if st.backward:
                    stage.set_loss(mb, loss * self.policy.scale(self.n_microbatches))
            return
        st.acts[(a.stage, mb)] = tuple(o.detach() for o in outs)

    def _backward(self, a: Action, i: int, st: _StepState) -> None:
        stage = self.stages[a.stage]
        mb = a.mb
        assert mb is not None
        grads = None
        if not stage.is_last:
            grads = self._take(st, (a.stage, mb, True))
            stage.check_grads(grads, mb, "received")
        if a.kind is ActionKind.B:
            self._sync[a.stage].before_backward(self._last_backward.get(a.stage) == i)
            in_grads = stage.backward(mb, grads)
        else:  # I: the input half; the stage's last backward is its W
            sync = self._sync[a.stage]
            sync.before_backward(False)
            with sync.split("input"):
                in_grads = stage.backward_input(mb, grads)
        if in_grads is not None:
            st.grads[(a.stage, mb)] = in_grads

    def _backward_weight(self, a: Action, i: int, st: _StepState) -> None:
        # See [Note: split backwards drive the same reductions] in grad_sync.py.
        sync = self._sync[a.stage]
        sync.before_backward(self._last_backward.get(a.stage) == i)
        mb = a.mb
        assert mb is not None
        with sync.split("weight"):
            self.stages[a.stage].backward_weight(mb)

    def _overlap(self, a: Action, i: int, st: _StepState) -> None:
        # FB_OVERLAP: the sub-actions run in order (a fused kernel would go here).
        for sub in a.sub:
            self._handlers[sub.kind](sub, i, st)

    # -- handlers: transfers ----------------------------------------------------

    def _send(self, a: Action, i: int, st: _StepState) -> None:
        comm, peer = self._route[a]
        grad = a.payload is Payload.GRAD
        tensors = (st.grads if grad else st.acts).pop((a.stage, a.mb))
        st.sends[_send_key(a)] = [comm.isend(t.contiguous(), peer) for t in tensors]

    def _recv(self, a: Action, i: int, st: _StepState) -> None:
        comm, peer = self._route[a]
        grad = a.payload is Payload.GRAD
        stage = self.stages[a.stage]
        bufs = stage.grad_buffers() if grad else stage.input_buffers()
        works = [comm.irecv(b, peer) for b in bufs]
        st.recvs.setdefault((a.stage, a.mb, grad), []).append((bufs, works))

    def _post_recv(
        self, actions: Sequence[Action], j: int, posted: set[int], st: _StepState
    ) -> None:
        if j not in posted:
            posted.add(j)
            self._recv(actions[j], j, st)

    def _post_batch(self, run: tuple[Action, ...], st: _StepState) -> None:
        # See [Note: batched P2P]: one batch per communicator, each in action order.
        ops: dict[int, tuple[Comm, list[tuple[Action, list[Any]]]]] = {}
        for a in run:
            comm, peer = self._route[a]
            batch = ops.setdefault(id(comm.group), (comm, []))[1]
            if a.kind is ActionKind.SEND:
                tensors = (st.grads if a.payload is Payload.GRAD else st.acts).pop((a.stage, a.mb))
                batch.append((a, [("send", t.contiguous(), peer) for t in tensors]))
            else:
                stage = self.stages[a.stage]
                bufs = stage.grad_buffers() if a.payload is Payload.GRAD else stage.input_buffers()
                batch.append((a, [("recv", b, peer) for b in bufs]))
        for comm, items in ops.values():
            works = iter(comm.batch_isend_irecv([op for _, part in items for op in part]))
            self.p2p_batches += 1
            for a, part in items:
                mine = [next(works) for _ in part]
                if a.kind is ActionKind.SEND:
                    st.sends[_send_key(a)] = mine
                else:
                    key = (a.stage, a.mb, a.payload is Payload.GRAD)
                    st.recvs.setdefault(key, []).append((tuple(t for _, t, _ in part), mine))

    def _local(self, a: Action, i: int, st: _StepState) -> None:
        # LOCAL: stage -> peer_stage on this rank, no P2P (the V turn, or looped
        # placements with several consecutive stages on one rank).
        grad = a.payload is Payload.GRAD
        tensors = (st.grads if grad else st.acts).pop((a.stage, a.mb))
        st.local[(a.peer_stage, a.mb, grad)] = tensors  # type: ignore[index]  # Action.__post_init__ sets a transfer's peer and payload; Optional on Action
        self.local_handoffs += 1
        if self.event_log is not None:
            self.event_log.mark("pp_local", src=a.stage, dst=a.peer_stage, mb=a.mb, grad=grad)

    def _wait_send(self, a: Action, i: int, st: _StepState) -> None:
        # The SEND this waits for has the same (producer, consumer, payload, mb, slot).
        for w in st.sends.get(_send_key(a), ()):
            w.wait()

    def _barrier(self, a: Action, i: int, st: _StepState) -> None:
        # Every send this rank issued so far completes (as the simulator models it).
        for works in st.sends.values():
            for w in works:
                w.wait()

    # -- handlers: data parallel ------------------------------------------------

    def _reduce_grad(self, a: Action, i: int, st: _StepState) -> None:
        if self.event_log is not None:
            self.event_log.mark("pp_reduce_grad", stage=a.stage, mb=a.mb)
        self._sync[a.stage].reduce()

    def _wait_reduce_grad(self, a: Action, i: int, st: _StepState) -> None:
        self._sync[a.stage].wait()
        if self.event_log is not None:
            self.event_log.mark("pp_wait_reduce_grad", stage=a.stage, mb=a.mb)


def _check_arguments(
    schedule: Schedule,
    channel_mode: ChannelMode,
    batch_p2p: bool,
    recv_lookahead: int | None,
    groups: ParallelGroups | None,
) -> tuple[int, tuple[int, ...]]:
    """The constructor's refusals, before `verify`; the receive lookahead and the pp ranks."""
    if not isinstance(schedule, Schedule):
        raise PipelineUsageError(
            f"PipelineRuntime takes a lowered cadence Schedule, got {type(schedule).__name__}; "
            "build one with Schedule.from_lists(actions, placement) and lower() it, or "
            "use build_pipeline(name, ...)"
        )
    if channel_mode not in CHANNEL_MODES:
        raise PipelineUsageError(f"channel_mode={channel_mode!r}; use one of {CHANNEL_MODES}")
    lookahead = check_lookahead(recv_lookahead, channel_mode, batch_p2p)
    pp_ranks = tuple(groups.pp_ranks) if groups is not None else tuple(range(dist.get_world_size()))
    if schedule.num_ranks != len(pp_ranks):
        raise PipelineUsageError(
            f"the schedule has {schedule.num_ranks} pipeline ranks but the pp group has "
            f"{len(pp_ranks)} ({list(pp_ranks)}); generate it for pp={len(pp_ranks)}"
        )
    return lookahead, pp_ranks


def _forward_only(a: Action) -> bool:
    if a.kind in _TRANSFERS:
        return a.payload is Payload.ACT
    return a.kind in _FORWARD_KINDS


def _send_key(a: Action) -> _SendKey:
    return (a.stage, a.peer_stage, a.payload, a.mb, a.slot)


class _StepState:
    """Everything one step keeps between actions."""

    def __init__(self, mbs: list[tuple[Any, ...]], targets: list[Any], backward: bool) -> None:
        self.mbs = mbs
        self.targets = targets
        self.backward = backward
        self.acts: dict[tuple[int, int | None], Tensors] = {}
        self.grads: dict[tuple[int, int | None], Tensors] = {}
        self.local: dict[tuple[int, int | None, bool], Tensors] = {}
        self.recvs: dict[tuple[int, int | None, bool], list[tuple[Tensors, list[CommWork]]]] = {}
        self.sends: dict[_SendKey, list[CommWork]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Tensors] = {}
