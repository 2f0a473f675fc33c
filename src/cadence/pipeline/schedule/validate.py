"""The rules a schedule must satisfy, and the dataflow they are stated in.

`validate_compute` checks a compute-only schedule (what a generator emits),
`validate_lowered` a lowered one (what the runtime executes). Both raise
`ScheduleValidationError` naming the rule, the rank and the action index. The
passes (``passes.py``) and the simulator (``sim.py``) build on this module; it
imports nothing but the IR, so both can use it without importing each other.

[Note: reduction rules]
A lowered schedule either reduces every stage's gradients or none (an
accumulation step, lowered with ``reduce_grad=False``). Where it does, each stage
has exactly one REDUCE_GRAD, on its own rank, after its last B or W (before that
its gradients are not final), and exactly one WAIT_REDUCE_GRAD after it in the
same step: a missing wait would leave a reduction in flight into the optimizer
step, a duplicate one or a second issue has no meaning.

[Note: the dataflow of a compute action]
F of stage s consumes the activation of stage s-1 (nothing on stage 0) and
produces its own for stage s+1. B and I of stage s consume the gradient that
stage s+1 produced (nothing on the last stage: the loss is its root) and produce
the gradient for stage s-1. W consumes and produces nothing across stages: it only
needs its own stage's I to have run. `inputs_of` / `outputs_of` state exactly this,
as ``(producer stage, consumer stage, payload, microbatch)`` edges; lowering turns
each cross-rank edge into a SEND/RECV pair and each same-rank edge into a LOCAL.
"""

from __future__ import annotations

from collections import Counter

from cadence.pipeline.schedule._errors import ScheduleValidationError
from cadence.pipeline.schedule.ir import Action, ActionKind, Payload, Schedule

__all__ = [
    "inputs_of",
    "outputs_of",
    "validate_compute",
    "validate_lowered",
    "validate_reductions",
    "validate_residency",
]

_COMM = (ActionKind.SEND, ActionKind.RECV, ActionKind.LOCAL, ActionKind.WAIT_SEND)
Edge = tuple[int, int, Payload, int]
# A transfer: (src stage, dst stage, payload, microbatch, slot). Action.__post_init__
# guarantees a transfer's payload and microbatch; the fields are Optional on Action.
TransferKey = tuple[int, int, Payload | None, int | None, int]


def _err(msg: str) -> ScheduleValidationError:
    return ScheduleValidationError(msg)


def _where(r: int, i: int, a: Action) -> str:
    # Formatted only when a rule fails: the checks run on every action of every
    # rank, and formatting each one would cost more than checking it.
    return f"rank {r}, action {i} ({a})"


# -- dataflow of compute actions -------------------------------------------------


def inputs_of(a: Action, n_stages: int) -> list[Edge]:
    """The edges a compute action consumes; see [Note: the dataflow of a compute action]."""
    out = []
    for c in a.compute_parts():
        assert c.mb is not None
        if c.kind is ActionKind.F and c.stage > 0:
            out.append((c.stage - 1, c.stage, Payload.ACT, c.mb))
        elif c.kind in (ActionKind.B, ActionKind.I) and c.stage + 1 < n_stages:
            out.append((c.stage + 1, c.stage, Payload.GRAD, c.mb))
    return out


def outputs_of(a: Action, n_stages: int) -> list[Edge]:
    """The edges a compute action produces; see [Note: the dataflow of a compute action]."""
    out = []
    for c in a.compute_parts():
        assert c.mb is not None
        if c.kind is ActionKind.F and c.stage + 1 < n_stages:
            out.append((c.stage, c.stage + 1, Payload.ACT, c.mb))
        elif c.kind in (ActionKind.B, ActionKind.I) and c.stage > 0:
            out.append((c.stage, c.stage - 1, Payload.GRAD, c.mb))
    return out


# -- validation ------------------------------------------------------------------


def validate_compute(sched: Schedule, m: int | None = None) -> None:
    """Check the compute actions; raise `ScheduleValidationError` naming the rule."""
    m = sched.meta.m if m is None else m
    n = sched.num_stages
    if m <= 0:
        raise _err("the schedule has no microbatches (meta.m == 0 and no compute actions)")
    counts: Counter[tuple[ActionKind, int, int]] = Counter()
    for r, acts in enumerate(sched.ranks):
        seen: set[tuple[ActionKind, int, int]] = set()
        for i, a in enumerate(acts):
            for c in a.compute_parts():
                assert c.mb is not None
                if sched.placement[c.stage] != r:
                    raise _err(
                        f"{_where(r, i, c)}: stage {c.stage} is placed on rank {sched.placement[c.stage]} "
                        f"but computes on rank {r}; a stage must live on exactly one rank"
                    )
                if c.mb >= m:
                    raise _err(f"{_where(r, i, c)}: microbatch {c.mb} is out of range 0..{m - 1}")
                key = (c.kind, c.stage, c.mb)
                if key in seen:
                    raise _err(f"{_where(r, i, c)}: {c} runs twice")
                if (
                    c.kind in (ActionKind.B, ActionKind.I)
                    and (ActionKind.F, c.stage, c.mb) not in seen
                ):
                    what = "Full backward" if c.kind is ActionKind.B else "Input backward"
                    raise _err(
                        f"{_where(r, i, c)}: {what} of stage {c.stage}, microbatch {c.mb} without first "
                        f"running its forward (B before F)"
                    )
                if c.kind is ActionKind.W and (ActionKind.I, c.stage, c.mb) not in seen:
                    raise _err(
                        f"{_where(r, i, c)}: weight backward of stage {c.stage}, microbatch {c.mb} before "
                        f"its input backward (W before I)"
                    )
                if c.kind is ActionKind.I and (ActionKind.B, c.stage, c.mb) in seen:
                    raise _err(f"{_where(r, i, c)}: microbatch has both a full B and an I/W split")
                seen.add(key)
                counts[key] += 1
    for s in range(n):
        for k in range(m):
            if not counts[(ActionKind.F, s, k)]:
                raise _err(
                    f"stage {s} (rank {sched.placement[s]}) is missing the forward of microbatch {k}"
                )
            full, inp, wgt = (
                counts[(ActionKind.B, s, k)],
                counts[(ActionKind.I, s, k)],
                counts[(ActionKind.W, s, k)],
            )
            if full == 0 and inp == 0:
                raise _err(
                    f"stage {s} (rank {sched.placement[s]}) is missing the backward of microbatch {k}"
                )
            if inp and not wgt:
                raise _err(
                    f"stage {s}, microbatch {k}: I without its W (the weight gradient is never computed)"
                )


def validate_lowered(sched: Schedule) -> None:
    """Check the lowered rules: pairing of SEND/RECV, consumption, LOCAL, waits,
    gradient reductions (`validate_reductions`), parameter residency
    (`validate_residency`)."""
    validate_compute(sched)
    validate_reductions(sched)
    validate_residency(sched)
    n = sched.num_stages
    sends: dict[TransferKey, tuple[int, int, Action]] = {}
    recvs: dict[TransferKey, tuple[int, int, Action]] = {}
    for r, acts in enumerate(sched.ranks):
        have: set[TransferKey] = set()  # inputs provided by an earlier RECV/LOCAL
        produced: set[tuple[int, int, Payload | None, int | None]] = set()
        for i, a in enumerate(acts):
            if a.kind in _COMM:
                peer = a.peer_stage
                if peer is None or not 0 <= peer < n:
                    raise _err(
                        f"{_where(r, i, a)}: peer stage {peer} is not a stage of this schedule"
                    )
                src, dst = (peer, a.stage) if a.kind is ActionKind.RECV else (a.stage, peer)
                key = (src, dst, a.payload, a.mb, a.slot)
                same = sched.placement[src] == sched.placement[dst]
                route = (sched.placement[src], sched.placement[dst])
                if a.channel is not None and a.channel != route:
                    raise _err(
                        f"{_where(r, i, a)}: channel {a.channel} but stage {src} -> {dst} is rank "
                        f"{route[0]} -> {route[1]}; a channel is (src rank, dst rank)"
                    )
                if a.kind is ActionKind.LOCAL:
                    if not same:
                        raise _err(
                            f"{_where(r, i, a)}: LOCAL between stages on ranks {sched.placement[src]} and {sched.placement[dst]}; use SEND/RECV"
                        )
                    if key[:4] not in produced:
                        raise _err(f"{_where(r, i, a)}: LOCAL before its producer ran on this rank")
                    have.add(key)
                elif same:
                    raise _err(
                        f"{_where(r, i, a)}: {a.kind.name} between stages {src} and {dst} on the same rank; use LOCAL"
                    )
                elif a.kind is ActionKind.SEND:
                    if key[:4] not in produced:
                        raise _err(
                            f"{_where(r, i, a)}: SEND before its producer ({src}{'F' if a.payload is Payload.ACT else 'B/I'}{a.mb}) ran"
                        )
                    if key in sends:
                        raise _err(f"{_where(r, i, a)}: duplicate SEND")
                    sends[key] = (r, i, a)
                elif a.kind is ActionKind.RECV:
                    if key in recvs:
                        raise _err(f"{_where(r, i, a)}: duplicate RECV")
                    recvs[key] = (r, i, a)
                    have.add(key)
            elif a.is_compute:
                for edge in inputs_of(a, n):
                    if (*edge, 0) not in have:
                        raise _err(
                            f"{_where(r, i, a)}: consumes the {edge[2].name.lower()} of stage {edge[0]}, "
                            f"microbatch {edge[3]}, but no earlier RECV or LOCAL on rank {r} provides it"
                        )
                    have.discard((*edge, 0))
                produced.update(outputs_of(a, n))
        for key in sorted(have, key=str):
            src, dst, payload, mb, _ = key
            assert payload is not None  # a transfer's payload (Action.__post_init__)
            raise _err(
                f"rank {r}: the {payload.name.lower()} of stage {src} -> {dst}, microbatch {mb} is "
                "received or handed over but never consumed (unconsumed RECV)"
            )
    for key, (r, i, a) in recvs.items():
        if key not in sends:
            raise _err(
                f"rank {r}, action {i} ({a}): RECV without a matching SEND on rank {sched.placement[key[0]]}"
            )
    for key, (r, i, a) in sends.items():
        if key not in recvs:
            raise _err(
                f"rank {r}, action {i} ({a}): SEND without a matching RECV on rank {sched.placement[key[1]]}"
            )


def validate_reductions(sched: Schedule) -> None:
    """The REDUCE_GRAD / WAIT_REDUCE_GRAD rules; see [Note: reduction rules]."""
    issued_any: dict[int, int] = {}  # stage -> rank, for stages with a REDUCE_GRAD
    for r, acts in enumerate(sched.ranks):
        last_grad: dict[int, int] = {}  # stage -> index of its last B or W here
        for i, a in enumerate(acts):
            for c in a.compute_parts():
                if c.kind in (ActionKind.B, ActionKind.W):
                    last_grad[c.stage] = i
        issued: dict[int, int] = {}  # stage -> index of its REDUCE_GRAD
        waited: dict[int, int] = {}
        for i, a in enumerate(acts):
            if a.kind not in (ActionKind.REDUCE_GRAD, ActionKind.WAIT_REDUCE_GRAD):
                continue
            if sched.placement[a.stage] != r:
                raise _err(
                    f"{_where(r, i, a)}: stage {a.stage} lives on rank {sched.placement[a.stage]}; "
                    "a stage's reduction runs on its own rank"
                )
            if a.kind is ActionKind.REDUCE_GRAD:
                if a.stage in issued:
                    raise _err(
                        f"{_where(r, i, a)}: duplicate REDUCE_GRAD for stage {a.stage} (first at action "
                        f"{issued[a.stage]}); a stage's gradients are reduced once per step"
                    )
                if i < last_grad.get(a.stage, -1):
                    raise _err(
                        f"{_where(r, i, a)}: REDUCE_GRAD for stage {a.stage} before its last backward "
                        f"(action {last_grad[a.stage]}); its gradients are not final yet"
                    )
                issued[a.stage] = i
            else:
                if a.stage not in issued:
                    raise _err(
                        f"{_where(r, i, a)}: WAIT_REDUCE_GRAD for stage {a.stage} before its REDUCE_GRAD"
                    )
                if a.stage in waited:
                    raise _err(
                        f"{_where(r, i, a)}: duplicate WAIT_REDUCE_GRAD for stage {a.stage} (first at "
                        f"action {waited[a.stage]})"
                    )
                waited[a.stage] = i
        for s, i in sorted(issued.items()):
            if s not in waited:
                raise _err(
                    f"rank {r}, action {i} ({acts[i]}): missing WAIT_REDUCE_GRAD for stage {s}; "
                    "a reduction issued in a step is waited for in the same step"
                )
        issued_any.update(dict.fromkeys(issued, r))
    missing = [s for s in range(sched.num_stages) if s not in issued_any]
    if issued_any and missing:
        raise _err(
            f"missing REDUCE_GRAD for stage(s) {missing} (on rank(s) "
            f"{sorted({sched.placement[s] for s in missing})}), while stage(s) "
            f"{sorted(issued_any)} have one: every stage reduces once per step, or none "
            "does (lower(..., reduce_grad=False))"
        )


def validate_residency(sched: Schedule) -> None:
    """The UNSHARD / RESHARD rules: where a schedule has any, every stage has one
    UNSHARD before its first compute and one RESHARD after its last, on its rank."""
    kinds = (ActionKind.UNSHARD, ActionKind.RESHARD)
    if not any(a.kind in kinds for acts in sched.ranks for a in acts):
        return
    for r, acts in enumerate(sched.ranks):
        seen: dict[tuple[ActionKind, int], int] = {}
        for i, a in enumerate(acts):
            if a.kind in kinds:
                if sched.placement[a.stage] != r:
                    raise _err(
                        f"{_where(r, i, a)}: stage {a.stage} lives on rank {sched.placement[a.stage]}; "
                        "its parameters are gathered and freed there"
                    )
                if (a.kind, a.stage) in seen:
                    raise _err(
                        f"{_where(r, i, a)}: duplicate {a.kind.name} for stage {a.stage} (first at action "
                        f"{seen[(a.kind, a.stage)]}); one gather and one free per step"
                    )
                if a.kind is ActionKind.RESHARD and (ActionKind.UNSHARD, a.stage) not in seen:
                    raise _err(f"{_where(r, i, a)}: RESHARD of stage {a.stage} before its UNSHARD")
                seen[(a.kind, a.stage)] = i
            for c in a.compute_parts():
                if (ActionKind.UNSHARD, c.stage) not in seen:
                    raise _err(
                        f"rank {r}, action {i} ({c}): stage {c.stage} computes before its "
                        "UNSHARD (its parameters are still sharded)"
                    )
                if (ActionKind.RESHARD, c.stage) in seen:
                    raise _err(
                        f"rank {r}, action {i} ({c}): stage {c.stage} computes after its "
                        f"RESHARD (action {seen[(ActionKind.RESHARD, c.stage)]}); reshard after the last use"
                    )
        for s in sched.stages_of(r):
            for kind in kinds:
                if (kind, s) not in seen:
                    raise _err(
                        f"rank {r}: missing {kind.name} for stage {s}; with UNSHARD/RESHARD in a "
                        "schedule every stage has one of each"
                    )
