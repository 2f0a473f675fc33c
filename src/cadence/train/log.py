"""The ``cadence.train`` logger: what a run says on its way (data, resume, evals, export).

[Note: a run's messages go through logging]
`cadence.train.train` is an application and a function a user calls from a job
script. Its messages are records of the ``cadence.train`` logger, so a script routes
or silences them as it does torch's (``logging.getLogger("cadence.train")``). Where
nothing is configured (no handler on the logger or any ancestor, as in a fresh
``cadence train`` process and in every rank it spawns), `console` attaches one that
writes ``cadence train: <message>`` to stderr at INFO, so the command line shows them.
The progress line and the summary table are the command's output, not messages:
`cadence.train.report` writes those.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["console", "logger"]

logger = logging.getLogger("cadence.train")


def console(target: logging.Logger = logger) -> None:
    """Show the run's messages on stderr, unless the caller configured logging."""
    if target.hasHandlers():  # the caller's (or an earlier call's) handlers decide
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("cadence train: %(message)s"))
    target.addHandler(handler)
    target.setLevel(logging.INFO)
