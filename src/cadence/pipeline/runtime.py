"""The pipeline executor: runs a rank's lowered action list, one handler per kind.

What it does, in order:
1. At construction: the global schedule must pass the simulator's verify (the
   runtime refuses one that does not); every rank votes on the plan digest and
   creates its channel groups (``groups.py``), preconnected, before any step.
2. ``step(*inputs, target=..., losses=...)``: split into microbatches (an uneven
   batch raises here, before any communication), infer stage metadata on the first
   step if it was not given, then execute this rank's actions in order.
3. SEND/RECV go through ``cadence.Comm(channel group).isend/irecv``: each directed
   channel is its own FIFO, so a channel's i-th send meets its i-th receive, and
   the runtime checks every op's sequence number against that count. LOCAL hands
   a tensor to another stage on the same rank without any P2P (the V turn).
4. On an error the rank's lowered schedule is raised with the failing action
   marked (``<-- ERROR HERE``), its channel and sequence number.

Sends are waited at the end of the step (their buffers are kept alive until then);
receives are waited just before the compute that consumes them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cadence.comm import Comm, CommWork, EventLog
from cadence.pipeline._ops import Op
from cadence.pipeline.dp import StageGradSync
from cadence.pipeline.groups import ChannelMode, build_channel_groups
from cadence.pipeline.microbatch import LossPolicy, merge_microbatches, split_microbatches
from cadence.pipeline.stage import PipelineStage, TensorMeta

__all__ = ["PipelineRuntime", "PipelineRuntimeError", "plan_digest"]

_BACKWARDS = ("B", "I", "W")


class PipelineRuntimeError(RuntimeError):
    """An action failed; the message carries the rank's schedule with it marked."""

    def __init__(self, message: str, *, rank: int, index: int, op: Op) -> None:
        super().__init__(message)
        self.rank = rank
        self.index = index
        self.op = op


def plan_digest(
    ops: Mapping[int, Sequence[Op]], placement: Mapping[int, int], channels: Sequence[tuple]
) -> str:
    """SHA-256 of placement + channels + every rank's lowered actions + version."""
    from cadence import __version__

    h = hashlib.sha256()
    h.update(repr(sorted(placement.items())).encode())
    h.update(repr(sorted(channels)).encode())
    for r in sorted(ops):
        h.update(f"|{r}:".encode() + ",".join(str(o) for o in ops[r]).encode())
    h.update(__version__.encode())
    return h.hexdigest()


def channels_of(ops: Mapping[int, Sequence[Op]]) -> list[tuple[int, int]]:
    """Directed channels from the lowered SENDs (not from the placement)."""
    out = set()
    for r_ops in ops.values():
        for o in r_ops:
            if o.kind == "SEND" and o.channel is not None and o.channel[0] != o.channel[1]:
                out.add(o.channel)
    return sorted(out)


class PipelineRuntime:
    """Execute a lowered pipeline schedule on this rank.

    Usually built by `build_pipeline` (``_build.py``) from a cadence
    ``Schedule``; this constructor takes the per-rank `Op` lists directly.

    Args:
        ops: rank -> lowered actions, for *every* rank (the plan is global).
        placement: stage -> pipeline rank.
        n_microbatches: microbatches per step.
        stages: this rank's `PipelineStage` objects.
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage.
        pp_ranks: global ranks of this rank's pp group, by pipeline position
            (``ParallelGroups.pp_ranks``); default: the whole world.
        pp_group: the pp process group (``ParallelGroups.pp``); default: world.
        loss_reduction: ``"mean"`` (default, equal to one process on the full batch)
            or ``"sum"``; see `LossPolicy`.
        channel_mode: ``"per_directed_edge"`` (default) or ``"shared"``.
        event_log: records every P2P with its channel (``event.group == "pp0->1"``)
            and every LOCAL hand-off as a mark named ``"pp_local"``.
        implicit_local: hand same-rank neighbours over without a LOCAL action
            (torch's lowered IR has none); cadence IR has explicit LOCALs.
    """

    def __init__(
        self,
        ops: Mapping[int, Sequence[Op]],
        placement: Mapping[int, int],
        n_microbatches: int,
        stages: Sequence[PipelineStage],
        *,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        pp_ranks: Sequence[int] | None = None,
        pp_group: dist.ProcessGroup | None = None,
        loss_reduction: str = "mean",
        channel_mode: ChannelMode = "per_directed_edge",
        event_log: EventLog | None = None,
        implicit_local: bool = False,
        digest: str | None = None,
        channels: Sequence[tuple[int, int]] | None = None,
        rounds: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> None:
        self.ops = {int(r): list(v) for r, v in ops.items()}
        self.placement = {int(s): int(r) for s, r in placement.items()}
        self.n_microbatches = int(n_microbatches)
        self.num_stages = len(self.placement)
        self.loss_fn = loss_fn
        self.policy = LossPolicy(loss_reduction)  # type: ignore[arg-type]
        self.event_log = event_log
        self.implicit_local = implicit_local
        self.pp_ranks = (
            tuple(pp_ranks) if pp_ranks is not None else tuple(range(dist.get_world_size()))
        )
        self.pp_rank = self.pp_ranks.index(dist.get_rank())
        self.stages = {st.stage_index: st for st in stages}
        # A local misuse is voted on with the plan (groups.py) rather than raised
        # here, so that the other ranks fail with it instead of hanging.
        local_error = None
        try:
            self._check_stages()
        except ValueError as e:
            local_error = str(e)
        self.local_ops = self.ops[self.pp_rank]
        self._sync = {s: StageGradSync(st.module) for s, st in self.stages.items()}
        self._last_backward = self._find_last_backwards()
        self.channels = list(channels) if channels is not None else channels_of(self.ops)
        self.digest = digest or plan_digest(self.ops, self.placement, self.channels)
        self._pp_comm = Comm(pp_group, name="pp")
        # Collective over the world; raises PlanMismatchError before any group exists.
        self.channel_groups = build_channel_groups(
            self.channels,
            pp_ranks=self.pp_ranks,
            digest=self.digest,
            mode=channel_mode,
            rounds=rounds,
            pp_group=pp_group,
            event_log=event_log,
            local_error=local_error,
        )
        self._comms = self.channel_groups.comms(event_log)
        self._meta_ready = False
        self.local_handoffs = 0  # lifetime count of LOCAL hand-offs (tests read it)

    # -- validation -----------------------------------------------------------

    def _check_stages(self) -> None:
        mine = {s for s, r in self.placement.items() if r == self.pp_rank}
        if set(self.stages) != mine:
            raise ValueError(
                f"pipeline rank {self.pp_rank} was given stages {sorted(self.stages)} but the "
                f"schedule places stages {sorted(mine)} on it; build exactly those stages "
                "on this rank (placement: stage -> rank "
                f"{dict(sorted(self.placement.items()))})"
            )
        for st in self.stages.values():
            if st.num_stages != self.num_stages:
                raise ValueError(
                    f"{st} says num_stages={st.num_stages}, the schedule has {self.num_stages}"
                )

    def _find_last_backwards(self) -> dict[int, int]:
        """Per local stage, the index of its last gradient-producing op (B or W)."""
        last: dict[int, int] = {}
        for i, op in enumerate(self.local_ops):
            for o in op.sub or (op,):
                if o.kind in ("B", "W") and o.stage in self.stages:
                    last[o.stage] = i
        return last

    # -- public API -------------------------------------------------------------

    def step(
        self,
        *inputs: Any,
        target: torch.Tensor | None = None,
        losses: list | None = None,
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
        return self._run(inputs, target, losses, backward=True, sync=sync_gradients)

    def eval(self, *inputs: Any, target: torch.Tensor | None = None, losses: list | None = None):
        """Forward only (no graph kept, no gradients): the F actions and their transfers."""
        with torch.no_grad():
            return self._run(inputs, target, losses, backward=False, sync=False)

    # -- step -------------------------------------------------------------------

    def _split(self, inputs: Sequence[Any], target: torch.Tensor | None):
        # Validate whatever this rank was given, even the inputs it does not use:
        # with the usual SPMD call (same arguments everywhere) an uneven batch then
        # fails on *every* rank here, instead of on one rank while its peers wait.
        m = self.n_microbatches
        mbs = split_microbatches(inputs, m)
        targets = [t[0] for t in split_microbatches([target], m)] if target is not None else None
        last = self.num_stages - 1
        if last in self.stages and self.loss_fn is not None and targets is None:
            raise ValueError("step() needs target= for the loss on the last stage")
        return mbs, targets or [None] * m

    def _run(self, inputs, target, losses, *, backward: bool, sync: bool):
        if backward and torch.is_grad_enabled() is False:
            raise RuntimeError("step() under torch.no_grad(); use eval() for forward only")
        if backward and self.loss_fn is None:
            raise ValueError("a training step needs loss_fn=...; use eval() for forward only")
        mbs, targets = self._split(inputs, target)
        if not self._meta_ready:
            self._infer_meta(mbs[0] if mbs else ())
        st = _StepState(mbs, targets)
        for s in self._sync.values():
            s.begin_step(sync and backward)
        if backward:
            ops = self.local_ops
        else:
            # Forward only: the F actions (also those inside an FB_OVERLAP) and the
            # activation transfers. Dropping every gradient transfer on both ends keeps
            # each channel's remaining sends and receives in matching FIFO order.
            flat = [x for o in self.local_ops for x in (o.sub if o.kind == "FB_OVERLAP" else (o,))]
            ops = [o for o in flat if _forward_only(o)]
        expected_seq: dict[Any, int] = {"forward_only": not backward}
        for i, op in enumerate(ops):
            try:
                self._execute(op, i, st, backward, expected_seq)
            except Exception as e:
                for stage in self.stages.values():
                    stage.clear()
                raise PipelineRuntimeError(
                    self._report(ops, i, e), rank=self.pp_rank, index=i, op=op
                ) from e
        for w in st.sends:
            w.wait()
        if backward:
            for s in self._sync.values():
                s.end_step()
        leftovers = [k for k, v in st.recvs.items() if v]
        if leftovers:
            raise RuntimeError(f"rank {self.pp_rank}: receives never consumed: {leftovers}")
        for stage in self.stages.values():
            stage.clear()
        if losses is not None and st.losses:
            losses.extend(st.losses[mb] for mb in sorted(st.losses))
        if st.outputs:
            return merge_microbatches([st.outputs[mb] for mb in sorted(st.outputs)])
        return None

    def _report(self, ops: Sequence[Op], index: int, exc: BaseException) -> str:
        lines = [
            f"pipeline rank {self.pp_rank} (global rank {dist.get_rank()}) failed at action "
            f"{index} ({ops[index]}): {type(exc).__name__}: {exc}",
            "lowered schedule of this rank:",
        ]
        for j, o in enumerate(ops):
            extra = ""
            if o.channel is not None:
                extra = f"  [channel {o.channel[0]}->{o.channel[1]} seq {o.seq}]"
            mark = "  <-- ERROR HERE" if j == index else ""
            lines.append(f"  {j:4d}  {o}{extra}{mark}")
        return "\n".join(lines)

    # -- handlers ---------------------------------------------------------------

    def _execute(self, op: Op, i: int, st: _StepState, backward: bool, seqs: dict) -> None:
        k = op.kind
        if k == "FB_OVERLAP":
            for sub in op.sub:
                self._execute(sub, i, st, backward, seqs)
        elif k == "F":
            self._forward(op, st, backward)
        elif k in ("B", "I"):
            self._backward(op, i, st)
        elif k == "W":
            sync = self._sync[op.stage]
            sync.before_backward(self._last_backward.get(op.stage) == i)
            self.stages[op.stage].backward_weight(op.mb)
        elif k in ("SEND", "RECV"):
            self._p2p(op, st, seqs)
        elif k == "LOCAL":
            self._local(op, st)
        elif k == "REDUCE_GRAD":
            self._mark("pp_reduce_grad", op)
            self._sync[op.stage].reduce()
        elif k == "WAIT_REDUCE_GRAD":
            self._sync[op.stage].wait()
            self._mark("pp_wait_reduce_grad", op)
        elif k == "UNSHARD":
            self._sync[op.stage].unshard()
        elif k == "RESHARD":
            self._sync[op.stage].reshard()
        elif k in ("WAIT_SEND", "BARRIER"):
            for w in st.sends:
                w.wait()
        else:
            raise NotImplementedError(f"no handler for action kind {k!r}")

    def _take(self, st: _StepState, key: tuple) -> tuple[torch.Tensor, ...]:
        if key in st.local:
            return st.local.pop(key)
        queue = st.recvs.get(key)
        if not queue:
            stage, mb, grad = key
            what = "gradient" if grad else "activation"
            raise RuntimeError(
                f"stage {stage} microbatch {mb}: its {what} input was neither received "
                "nor handed over locally before it was needed (the schedule lacks a "
                "RECV/LOCAL, or orders it after its consumer)"
            )
        bufs, works = queue.pop(0)
        for w in works:
            w.wait()
        return bufs

    def _forward(self, op: Op, st: _StepState, backward: bool) -> None:
        stage = self.stages[op.stage]
        mb = op.mb
        if stage.is_first:
            inputs, how = st.mbs[mb], "user input"
        else:
            how = "received" if (op.stage, mb, False) not in st.local else "local hand-off"
            inputs = self._take(st, (op.stage, mb, False))
        outs = stage.forward(mb, inputs, how=how)
        if stage.is_last:
            st.outputs[mb] = tuple(o.detach() for o in outs)
            if self.loss_fn is not None:
                loss = self.loss_fn(*outs, st.targets[mb])
                st.losses[mb] = loss.detach()
                if backward:
                    stage.set_loss(mb, loss * self.policy.scale(self.n_microbatches))
            return
        sent = tuple(o.detach() for o in outs)
        if self.implicit_local and self.placement.get(op.stage + 1) == self.pp_rank:
            st.local[(op.stage + 1, mb, False)] = sent
            self._count_local(op.stage, op.stage + 1, mb, False)
        else:
            st.acts[(op.stage, mb)] = sent

    def _backward(self, op: Op, i: int, st: _StepState) -> None:
        stage = self.stages[op.stage]
        mb = op.mb
        grads = None
        if not stage.is_last:
            grads = self._take(st, (op.stage, mb, True))
            stage.check_grads(grads, mb, "received")
        if op.kind == "B":
            self._sync[op.stage].before_backward(self._last_backward.get(op.stage) == i)
            in_grads = stage.backward(mb, grads)
        else:
            self._sync[op.stage].before_backward(False)
            in_grads = stage.backward_input(mb, grads)
        if in_grads is None:
            return
        if self.implicit_local and self.placement.get(op.stage - 1) == self.pp_rank:
            st.local[(op.stage - 1, mb, True)] = in_grads
            self._count_local(op.stage, op.stage - 1, mb, True)
        else:
            st.grads[(op.stage, mb)] = in_grads

    def _p2p(self, op: Op, st: _StepState, seqs: dict) -> None:
        if op.channel is None or op.channel not in self._comms:
            raise RuntimeError(
                f"{op}: no channel group for {op.channel}; channels of this rank: "
                f"{sorted(self._comms)}"
            )
        # Sequence numbers: the i-th op on a channel must be the i-th of the plan,
        # otherwise the FIFO would pair it with the wrong message (design note §2.11 2).
        key = (op.channel, op.kind)
        expect = seqs.get(key, 0)
        # (Forward-only runs drop the gradient ops, so the plan's numbers skip.)
        if op.seq is not None and op.seq != expect and not seqs.get("forward_only"):
            raise RuntimeError(
                f"{op}: sequence number {op.seq} on channel {op.channel} but this is "
                f"op #{expect} on it; the lowered schedule is out of FIFO order"
            )
        seqs[key] = expect + 1
        comm, peer = self._comms[op.channel]
        stage = self.stages[op.stage]
        if op.kind == "SEND":
            src = st.grads if op.grad else st.acts
            tensors = src.pop((op.stage, op.mb), None)
            if tensors is None:
                raise RuntimeError(
                    f"{op}: nothing to send: stage {op.stage} has not produced the "
                    f"{'input gradient' if op.grad else 'output'} of microbatch {op.mb} yet"
                )
            for t in tensors:
                st.sends.append(comm.isend(t.contiguous(), peer))
        else:
            bufs = stage.grad_buffers() if op.grad else stage.input_buffers()
            works = [comm.irecv(b, peer) for b in bufs]
            st.recvs.setdefault((op.stage, op.mb, op.grad), []).append((bufs, works))

    def _local(self, op: Op, st: _StepState) -> None:
        # LOCAL: stage -> peer_stage on this rank, no P2P (the V turn, or looped
        # placements with several consecutive stages on one rank).
        dst = op.peer_stage
        if dst is None:
            raise RuntimeError(f"{op}: a LOCAL hand-off needs its destination stage")
        src = st.grads if op.grad else st.acts
        tensors = src.pop((op.stage, op.mb), None)
        if tensors is None:
            raise RuntimeError(
                f"{op}: stage {op.stage} microbatch {op.mb} has nothing to hand over"
            )
        st.local[(dst, op.mb, op.grad)] = tensors
        self._count_local(op.stage, dst, op.mb, op.grad)

    def _mark(self, name: str, op: Op) -> None:
        if self.event_log is not None:
            self.event_log.mark(name, stage=op.stage, mb=op.mb)

    def _count_local(self, src: int, dst: int, mb: int | None, grad: bool) -> None:
        self.local_handoffs += 1
        if self.event_log is not None:
            self.event_log.mark("pp_local", src=src, dst=dst, mb=mb, grad=grad)

    # -- metadata ---------------------------------------------------------------

    def _infer_meta(self, mb0: Sequence[Any]) -> None:
        """Agree on every stage's input/output metadata, once, before the first step.

        One vote over the pp group decides static vs inferred (all ranks must take
        the same branch, or they would disagree on the broadcasts that follow).
        Inference runs each stage once on zeros in stage order, in eval mode so
        that running statistics are not updated, and broadcasts its output metadata.
        """
        complete = all(
            st.output_meta is not None and (st.is_first or st.input_meta is not None)
            for st in self.stages.values()
        )
        if all(self._pp_comm.all_gather_object(complete)):
            self._meta_ready = True
            return
        for s in range(self.num_stages):
            owner = self.placement[s]
            meta = None
            if owner == self.pp_rank:
                stage = self.stages[s]
                if s == 0:
                    inputs = tuple(mb0)
                    if all(isinstance(t, torch.Tensor) for t in inputs):
                        stage.input_meta = tuple(TensorMeta.of(t) for t in inputs)
                else:
                    inputs = tuple(torch.zeros(m.shape, dtype=m.dtype) for m in stage.input_meta)
                was_training = stage.module.training
                stage.module.eval()
                try:
                    meta = stage.infer_output_meta(inputs)
                finally:
                    stage.module.train(was_training)
            meta = self._pp_comm.broadcast_object(meta, src=owner)
            nxt = self.stages.get(s + 1)
            if nxt is not None and nxt.input_meta is None:
                nxt.input_meta = tuple(meta)
        self._meta_ready = True


def _forward_only(op: Op) -> bool:
    if op.kind == "F":
        return True
    if op.kind in ("SEND", "RECV", "LOCAL"):
        return not op.grad
    return op.kind in ("UNSHARD", "RESHARD")


class _StepState:
    """Everything one step keeps between actions."""

    def __init__(self, mbs: list, targets: list) -> None:
        self.mbs = mbs
        self.targets = targets
        self.acts: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.grads: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.local: dict[tuple[int, int, bool], tuple[torch.Tensor, ...]] = {}
        self.recvs: dict[tuple[int, int, bool], list[tuple[tuple, list[CommWork]]]] = {}
        self.sends: list[CommWork] = []
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
