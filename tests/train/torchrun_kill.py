"""A torchrun entry point for the lost-rank tests: ``cadence`` with a fault.

On the first attempt (``TORCHELASTIC_RESTART_COUNT=0``) the rank named by
``CADENCE_TEST_KILL_RANK`` SIGKILLs itself just before step ``CADENCE_TEST_KILL_AT``:
a real, unannounced death mid-run, at a step the test chooses.
"""

from __future__ import annotations

import os
import signal
import sys

import cadence.train.loop as loop_module
from cadence.cli import main


def _arm(kill_at: int, kill_rank: str) -> None:
    real = loop_module.train_step

    def train_step(state, x, y, reduce_loss):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if state.step + 1 == kill_at and os.environ["RANK"] == kill_rank and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(state, x, y, reduce_loss)

    loop_module.train_step = train_step


if __name__ == "__main__":
    _arm(int(os.environ["CADENCE_TEST_KILL_AT"]), os.environ.get("CADENCE_TEST_KILL_RANK", "1"))
    sys.exit(main(sys.argv[1:]))
