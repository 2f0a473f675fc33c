"""The public surface of `cadence.pipeline`.

Specification:

- ``cadence.pipeline`` lists a dozen names; each resolves, without a warning, to the
  very object its home in ``cadence.pipeline.schedule`` or ``cadence.pipeline.runtime``
  holds. Everything else lives in those two subpackages.
- The spellings of the flat layout that came before the schedule/runtime split were
  never released, so they are gone: ``cadence.pipeline.TimeModel`` is an
  `AttributeError` and ``import cadence.pipeline.passes`` a `ModuleNotFoundError`.
- ``from cadence.pipeline.runtime import PipelineRuntime`` works: the runtime is a
  package.
- ``cadence.train.add_train_subcommand`` still resolves, with a `DeprecationWarning`,
  to the parser hook in `cadence.cli` (cadence.train still lists it).
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
    "Stage",
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
    assert set(dir(pipeline)) >= SHORT


# Names and modules of the unreleased flat layout; each now lives in a subpackage.
OLD_NAMES = ["TimeModel", "gpipe", "ChannelPlan", "LossPolicy", "StageGradSync"]
OLD_MODULES = [
    "cadence.pipeline.ir",
    "cadence.pipeline.generators",
    "cadence.pipeline.passes",
    "cadence.pipeline.sim",
    "cadence.pipeline.topology",
    "cadence.pipeline.viz",
    "cadence.pipeline.cli",
    "cadence.pipeline.stage",
    "cadence.pipeline.microbatch",
    "cadence.pipeline.groups",
    "cadence.pipeline.dp",
    "cadence.pipeline._build",
]


@pytest.mark.parametrize("name", OLD_NAMES)
def test_names_of_the_flat_layout_are_gone(name: str) -> None:
    assert hasattr(schedule, name) or hasattr(runtime, name)  # where it lives now
    with pytest.raises(AttributeError, match=f"has no attribute {name!r}"):
        getattr(pipeline, name)


@pytest.mark.parametrize("old", OLD_MODULES)
def test_modules_of_the_flat_layout_are_gone(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_the_runtime_module_became_a_package() -> None:
    from cadence.pipeline.runtime import PipelineRuntime, PipelineRuntimeError
    from cadence.pipeline.runtime.executor import PipelineRuntime as P

    assert PipelineRuntime is P and issubclass(PipelineRuntimeError, RuntimeError)
