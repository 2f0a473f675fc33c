"""``cadence.train``'s messages go through its logger (see [Note: a run's messages go
through logging]).

Specification: where nothing is configured, `console` shows the messages on stderr as
``cadence train: <message>`` at INFO, once however often it is called; where the
caller configured logging (a handler on the logger or an ancestor), it adds nothing
and the caller's handlers receive the records.
"""

from __future__ import annotations

import logging

import pytest

from cadence.train.log import console, logger


@pytest.fixture
def bare_logger() -> logging.Logger:
    """A logger as a fresh process has ``cadence.train``: no handler on it or above
    (pytest's capture handlers sit on the real root, so this one has no parent)."""
    return logging.Logger("cadence.train")


def test_the_run_logs_to_cadence_train() -> None:
    assert logger.name == "cadence.train"


def test_unconfigured_messages_reach_stderr_once(
    bare_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    console(bare_logger)
    console(bare_logger)
    bare_logger.info("exported the weights to %s", "w.safetensors")
    err = capsys.readouterr().err
    assert err == "cadence train: exported the weights to w.safetensors\n", err
    assert len(bare_logger.handlers) == 1, bare_logger.handlers


def test_a_callers_configuration_is_left_alone(
    bare_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    records: list[logging.LogRecord] = []
    mine = logging.Handler()
    mine.emit = records.append  # type: ignore[method-assign]
    bare_logger.addHandler(mine)
    bare_logger.setLevel(logging.INFO)
    console(bare_logger)
    bare_logger.info("eval after step %d: loss %.4f", 3, 1.5)
    assert bare_logger.handlers == [mine], bare_logger.handlers
    assert [r.getMessage() for r in records] == ["eval after step 3: loss 1.5000"]
    assert capsys.readouterr().err == ""
