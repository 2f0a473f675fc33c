"""`RunHistory`: what a run has done so far, carried across checkpoints and restarts.

Torch-free: the report and the plots read it without importing torch. A checkpoint
stores it, so after a resume ``metrics.json`` and ``loss.png`` show the whole curve
from step 1, with the checkpoints and the restarts marked.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = ["RunHistory"]


@dataclass
class RunHistory:
    """Per-step losses and the run's events, in step numbers (step ``i`` is the
    ``i``-th optimizer step, counted from 1).

    Attributes:
        losses: the logged loss of every step so far (``losses[i - 1]`` is step ``i``).
        checkpoints: steps after which a checkpoint was written (and completed).
        resumes: steps a restart continued from (the step of the checkpoint it loaded).
        evals: ``(step, loss)`` of every evaluation on the held-out tokens
            (``--eval-every``), after that step.
    """

    losses: list[float] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)

    @property
    def step(self) -> int:
        """Steps done: the next step's data position."""
        return len(self.losses)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunHistory:
        raw = json.loads(text)
        return cls(
            losses=[float(x) for x in raw["losses"]],
            checkpoints=[int(x) for x in raw["checkpoints"]],
            resumes=[int(x) for x in raw["resumes"]],
            # Absent from the checkpoints of a cadence without evaluations.
            evals=[(int(s), float(x)) for s, x in raw.get("evals", [])],
        )
