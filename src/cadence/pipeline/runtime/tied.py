"""Parameters tied across pipeline stages (an input embedding reused as the output head).

[Note: tied parameters across stages]
A weight used by two stages (Megatron's shared embedding: stage 0 embeds, the
last stage projects onto the vocabulary with the same matrix) lives as one copy
per stage. Each copy gets the gradient of its own uses; the true gradient is
their sum. So after a syncing step, once every local stage's data-parallel
reduction has been waited, each tie sums its copies' gradients: locally when the
copies sit on one rank (the V schedules place stage 0 and the last stage on pp
rank 0), else with one all-reduce over the pp ranks that hold them (one group
per tie and pp group, created at construction). The copies start equal (the
caller builds them from one model) and receive equal gradients, so equal
optimizer steps keep them equal. Summing data-parallel *averages* gives the
average of the sums, so the order against the dp reduction does not matter for
the result; after it, the all-reduce moves the reduced (or sharded) gradient,
which is what each copy holds then.

Accumulation steps (``sync_gradients=False``) sum nothing: the sum of the
accumulated totals at the syncing step is the same, and summing at every step
would add earlier steps' gradients twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from cadence.comm import Comm, EventLog
from cadence.pipeline.runtime.errors import PipelineUsageError
from cadence.topology import subgroup_timeout

__all__ = ["TieSpec", "Tied", "TiedParameters", "Ties", "check_ties", "find_tied", "resolve_ties"]

# One tie: the (stage, parameter name in that stage's module) of every copy.
TieSpec = Sequence[tuple[int, str]]
Ties = tuple[tuple[tuple[int, str], ...], ...]  # checked ties, the same on every rank
Tied = dict[tuple[int, str], nn.Parameter]  # this rank's copies, by (stage, name)


def check_ties(ties: Sequence[TieSpec], num_stages: int) -> tuple[tuple[tuple[int, str], ...], ...]:
    """Normalise and validate ``tied_parameters`` (the same on every rank)."""
    out = []
    seen: set[tuple[int, str]] = set()
    for i, tie in enumerate(ties):
        copies = tuple((int(s), str(name)) for s, name in tie)
        if len({s for s, _ in copies}) < 2 or len(copies) != len({s for s, _ in copies}):
            raise PipelineUsageError(
                f"tied_parameters[{i}] = {list(copies)}: a tie names one parameter in each "
                "of two or more different stages"
            )
        for s, name in copies:
            if not 0 <= s < num_stages:
                raise PipelineUsageError(
                    f"tied_parameters[{i}] names stage {s}; the schedule has 0..{num_stages - 1}"
                )
            if (s, name) in seen:
                raise PipelineUsageError(
                    f"tied_parameters: ({s}, {name!r}) is in two ties; merge them into one"
                )
            seen.add((s, name))
        out.append(copies)
    return tuple(out)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's gradient (a DTensor's local shard)."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def find_tied(
    ties: tuple[tuple[tuple[int, str], ...], ...], modules: Mapping[int, nn.Module]
) -> dict[tuple[int, str], nn.Parameter]:
    """This rank's copies, looked up by name in its stage modules."""
    params: dict[tuple[int, str], nn.Parameter] = {}
    errors = []
    for tie in ties:
        for s, name in tie:
            if s in modules:
                try:
                    params[(s, name)] = modules[s].get_parameter(name)
                except AttributeError:
                    errors.append(f"stage {s} has no parameter {name!r}")
    if errors:
        raise PipelineUsageError("tied_parameters: " + "; ".join(errors))
    return params


def resolve_ties(
    ties: Sequence[TieSpec], num_stages: int, modules: Mapping[int, nn.Module]
) -> tuple[Ties, Tied, str | None]:
    """`check_ties` then `find_tied`, a failure returned: the plan vote reports it everywhere."""
    checked: Ties = ()
    try:
        checked = check_ties(ties, num_stages)
        return checked, find_tied(checked, modules), None
    except PipelineUsageError as e:
        return checked, {}, str(e)


class TiedParameters:
    """The ties of this rank's stages and the groups that sum them; see the note.

    Collective over the world when a tie spans ranks (one ``new_group`` per tie and
    pp group); every rank must pass the same ties (the plan vote checks it).
    """

    def __init__(
        self,
        ties: tuple[tuple[tuple[int, str], ...], ...],
        params: Mapping[tuple[int, str], nn.Parameter],
        placement: Sequence[int],
        all_pp_groups: Sequence[Sequence[int]],
        event_log: EventLog | None,
    ) -> None:
        self._mine: list[tuple[list[nn.Parameter], Comm | None]] = []
        me = dist.get_rank()
        for tie in ties:
            holders = sorted({placement[s] for s, _ in tie})
            group: dist.ProcessGroup | None = None
            for pp in all_pp_groups if len(holders) > 1 else ():
                ranks = [pp[r] for r in holders]
                g = dist.new_group(ranks=ranks, timeout=subgroup_timeout())
                if me in ranks:
                    # new_group gives its members a ProcessGroup (the others
                    # NON_GROUP_MEMBER, which torch's annotation adds).
                    group = cast(dist.ProcessGroup, g)
            local = [params[c] for c in tie if c in params]
            if local:
                comm = Comm(group, event_log=event_log, name="pp_tied") if group else None
                self._mine.append((local, comm))

    def __bool__(self) -> bool:
        return bool(self._mine)

    def sum_grads(self) -> None:
        """Give every copy the sum of all copies' gradients (after the dp reductions)."""
        for params, comm in self._mine:
            grads = [p.grad for p in params if p.grad is not None]
            if len(grads) < len(params):
                raise PipelineUsageError(
                    "a tied parameter copy has no gradient after the step; every copy must "
                    "be used by its stage"
                )
            total = _local(grads[0]).clone()
            for g in grads[1:]:
                total += _local(g)
            if comm is not None:
                comm.all_reduce(total, op="sum")
            for g in grads:
                _local(g).copy_(total)
