"""The public surface of `cadence.pipeline`, and the old spellings that still work.

Specification: ``cadence.pipeline`` lists a dozen names (the rest lives in
``cadence.pipeline.schedule`` and ``cadence.pipeline.runtime``); every name and
module that moved in the schedule/runtime split still resolves under its old
spelling, to the very same object, with a `DeprecationWarning` naming the new home.
"""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

import cadence.pipeline as pipeline
from cadence.pipeline import runtime, schedule

SHORT = {
    "Action",
    "ActionKind",
    "PipelineRuntime",
    "PipelineStage",
    "Schedule",
    "ScheduleValidationError",
    "build_pipeline",
    "channel_plan",
    "generate",
    "lower",
    "simulate",
    "verify",
}


def test_short_all_resolves_without_warnings() -> None:
    assert set(pipeline.__all__) == SHORT
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in SHORT:
            got = getattr(pipeline, name)
            home = schedule if hasattr(schedule, name) else runtime
            assert got is getattr(home, name), name


@pytest.mark.parametrize("name", sorted(pipeline._MOVED))
def test_moved_names_warn_and_return_the_same_object(name: str) -> None:
    home, _, attr = pipeline._MOVED[name].partition(":")
    with pytest.warns(DeprecationWarning, match=f"cadence.pipeline.{name} moved to {home}"):
        old = getattr(pipeline, name)
    assert old is getattr(importlib.import_module(home), attr)


OLD_MODULES = {
    "cadence.pipeline.ir": ("Schedule", schedule.Schedule),
    "cadence.pipeline.generators": ("generate", schedule.generate),
    "cadence.pipeline.passes": ("repair_deadlocks", schedule.repair_deadlocks),
    "cadence.pipeline.sim": ("chrome_trace", schedule.chrome_trace),
    "cadence.pipeline.topology": ("channel_plan", schedule.channel_plan),
    "cadence.pipeline.viz": ("ascii_grid", schedule.ascii_grid),
    "cadence.pipeline.stage": ("PipelineStage", runtime.PipelineStage),
    "cadence.pipeline.microbatch": ("LossPolicy", runtime.LossPolicy),
    "cadence.pipeline.groups": ("canonical_rounds", schedule.plan_rounds),
    "cadence.pipeline.dp": ("StageGradSync", runtime.StageGradSync),
    "cadence.pipeline._build": ("placement_for", schedule.placement_for),
}


@pytest.mark.parametrize("old", sorted(OLD_MODULES))
def test_moved_modules_import_with_a_warning(old: str) -> None:
    sys.modules.pop(old, None)
    name, new = OLD_MODULES[old]
    with pytest.warns(DeprecationWarning, match=f"module {old} moved to"):
        mod = importlib.import_module(old)
    assert getattr(mod, name) is new
    assert name in dir(mod)


def test_old_cli_and_train_spellings() -> None:
    from cadence import cli

    sys.modules.pop("cadence.pipeline.cli", None)
    with pytest.warns(DeprecationWarning, match="module cadence.pipeline.cli moved to cadence.cli"):
        from cadence.pipeline.cli import add_schedule_subcommand
    assert add_schedule_subcommand is cli.add_schedule_subcommand
    import cadence.train

    with pytest.warns(DeprecationWarning, match="moved to cadence.cli.add_train_subcommand"):
        assert cadence.train.add_train_subcommand is cli.add_train_subcommand


def test_the_runtime_module_became_a_package() -> None:
    # ``from cadence.pipeline.runtime import PipelineRuntime`` needs no alias.
    from cadence.pipeline.runtime import PipelineRuntime, PipelineRuntimeError
    from cadence.pipeline.runtime.executor import PipelineRuntime as P

    assert PipelineRuntime is P and issubclass(PipelineRuntimeError, RuntimeError)
