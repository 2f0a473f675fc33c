"""Private autograd-engine hooks, behind one module.

DataParallel and fully_shard need two things torch does not expose publicly:
whether code runs inside a backward (and in which graph task), and a callback
at the end of the current graph task. Keeping both here means one file to
update when torch renames them; every supported torch (2.13 to 2.15) has both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import Variable

__all__ = ["current_graph_task_id", "in_backward", "queue_callback"]


def current_graph_task_id() -> int:
    """The id of the running autograd graph task, or -1 outside backward.

    Nested (reentrant) backwards, e.g. reentrant activation checkpointing, run in
    their own graph task, so comparing ids tells the outermost task apart.
    """
    return int(torch._C._current_graph_task_id())


def in_backward() -> bool:
    return current_graph_task_id() != -1


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the *current* graph task finishes (must be called inside backward)."""
    Variable._execution_engine.queue_callback(fn)
