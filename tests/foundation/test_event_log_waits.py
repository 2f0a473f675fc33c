"""A collective's event shows its wait as it happens, not only once it returns.

Specification:
- while ``CommWork.wait()`` blocks, the event has a ``wait_start_t`` and no
  ``wait_end_t``: this is how a rank that times out names the collective it was
  stuck in (``cadence train``'s timeout message reads it);
- once ``wait()`` returns, the event is closed and the log's wait totals count it.
"""

from __future__ import annotations

import torch

from cadence import EventLog
from cadence.comm import CommWork


class _SeenWhileBlocked:
    """A stand-in backend work that records what the event looked like inside wait()."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.seen: tuple[float | None, float | None] | None = None

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        (event,) = self.log.collectives()
        self.seen = (event.wait_start_t, event.wait_end_t)


def test_a_blocked_wait_is_visible_as_started_and_unfinished() -> None:
    log = EventLog()
    event = log.record("all_reduce", "dp", torch.zeros(4))
    work = _SeenWhileBlocked(log)
    CommWork(work, event=event).wait()
    assert work.seen is not None
    started, ended = work.seen
    assert started is not None and started >= event.issue_t
    assert ended is None


def test_a_finished_wait_is_closed_and_counted() -> None:
    log = EventLog()
    event = log.record("all_reduce", "dp", torch.zeros(4))
    CommWork(_SeenWhileBlocked(log), event=event).wait()
    assert event.waited and event.wait_end_t is not None
    assert event.wait_start_t is not None and event.wait_end_t >= event.wait_start_t
    assert log.total_wait_time("all_reduce") == event.wait_end_t - event.wait_start_t
