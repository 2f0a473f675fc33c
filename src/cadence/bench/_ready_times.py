"""When each bucket's gradients are ready, measured on a stage that reduces nothing.

The pipeline's bound on a link (see [Note: the bound perfect overlap allows] in
`_bound.py`) needs the earliest time each data-parallel bucket could start on the
wire: when the last gradient it holds was accumulated in the step's last backward
through its stage. Measured on the ``plain`` variant (the same stage and schedule, no
reduction), that is what compute alone allows; measured on a reducing variant it
would excuse that variant's own delays.

A post-accumulate-grad hook per parameter stamps the time its gradient landed; a
bucket is ready when the latest of its parameters' is. The hooks cost one Python
call per parameter per microbatch. The stamp is the host's clock: on a GPU it is
when the accumulation was enqueued, no later than when it ran, so a bound read from
it stays a lower bound.
"""

from __future__ import annotations

import functools
import time
from typing import Any

__all__ = ["GradReadyTimes"]


class GradReadyTimes:
    """The time each group of ``module``'s parameters (named as ``named_parameters``
    names them: a bucket) last had a gradient accumulated, one reading per step."""

    def __init__(self, module: Any, groups: list[list[str]]) -> None:
        params = dict(module.named_parameters())
        unknown = sorted(n for g in groups for n in g if n not in params)
        if unknown or not all(groups) or not groups:
            raise ValueError(
                f"every group must name at least one of the module's parameters; unknown: "
                f"{unknown}, groups: {[len(g) for g in groups]}"
            )
        self._groups = [list(g) for g in groups]
        self._landed: dict[str, float] = {}
        # The hooks live as long as the module: a case's plain variant, read every step.
        for n in (n for g in self._groups for n in g):
            params[n].register_post_accumulate_grad_hook(functools.partial(self._stamp, n))

    def _stamp(self, name: str, _param: Any) -> None:
        self._landed[name] = time.perf_counter()

    def take(self, t0: float) -> list[float]:
        """Each group's ready time in ms after ``t0`` (``time.perf_counter``), for the
        gradients accumulated since the previous ``take``; then starts the next step."""
        missing = [n for g in self._groups for n in g if n not in self._landed]
        if missing:
            raise RuntimeError(
                f"no gradient was accumulated for {missing} this step: the step must run a "
                "backward through every parameter of the stage (a split backward's weight "
                "half included) before its ready times are read"
            )
        out = [1e3 * (max(self._landed[n] for n in g) - t0) for g in self._groups]
        self._landed.clear()
        return out
