"""Misuse and frozen state are refused before any compile; the public surface; key logic."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import cadence
from cadence.errors import CadenceError
from cadence.precompiling import (
    FrozenStateError,
    PrecompileError,
    PrecompileUsageError,
    _capture,
    _function,
    _key,
    stats,
)
from tests.precompiling import _bodies
from tests.precompiling._bodies import TinyNet, inputs, step


@pytest.fixture(autouse=True)
def no_compile() -> Any:
    """Every test here is refused (or answered) before torch compiles anything."""
    before = stats()["compiles"]
    yield
    assert stats()["compiles"] == before


def _args() -> tuple[Any, ...]:
    model, x, y = inputs()
    return model, x, y


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: cadence.precompile(42, ()), "fn must be callable, got int"),
        (lambda: cadence.precompile(TinyNet(), ()), "for a module use"),
        (lambda: cadence.precompile(step, _args()[0]), "example_args must be a tuple"),
        (
            lambda: cadence.precompile(step, _args(), {1: 2}),
            "example_kwargs must be None or a dict",
        ),
        (
            lambda: cadence.precompile(step, _args(), on_guard_failure="retry"),
            "on_guard_failure must be 'raise' or 'compile', got 'retry'",
        ),
        (
            lambda: cadence.precompile(step, _args(), backend=lambda gm, ex: gm),
            "a callable backend cannot be part of a cache key",
        ),
        (lambda: cadence.precompile(step, _args(), dynamic="yes"), "dynamic must be None"),
        (
            lambda: cadence.precompile(step, _args(), mode="reduce-overhead", options={"a": 1}),
            "pass mode or options, not both",
        ),
        (lambda: cadence.precompile(step, _args(), cache_dir=3), "cache_dir must be a path"),
        (lambda: cadence.precompile(step, _args(), src=1), r"src must be a group rank in \[0, 1\)"),
        (
            lambda: cadence.precompile(step, _args(), group=object()),
            "group was given but torch.distributed is not initialized",
        ),
        (lambda: cadence.precompiling.precompile_module(step, ()), "module must be an nn.Module"),
    ],
    ids=[
        "not-callable",
        "module",
        "args-not-tuple",
        "kwargs-keys",
        "on-guard-failure",
        "callable-backend",
        "dynamic",
        "mode-and-options",
        "cache-dir",
        "src",
        "group-without-dist",
        "module-not-module",
    ],
)
def test_misuse_is_refused_with_the_fix(call: Any, message: str) -> None:
    with pytest.raises(PrecompileUsageError, match=message) as info:
        call()
    assert isinstance(info.value, (CadenceError, ValueError, TypeError))


def test_precompiled_twice_is_refused() -> None:
    model = TinyNet()
    model.forward = lambda x: x  # type: ignore[method-assign]
    with pytest.raises(PrecompileUsageError, match="already replaced on this instance"):
        cadence.precompiling.precompile_module(model, (torch.randn(2, 4),))


@pytest.mark.parametrize(
    ("fn", "path"),
    [
        (
            _bodies.make_closure_step(torch.ones(2)),
            "make_closure_step.<locals>.closure_step.__closure__ 'w' (tensor 2",
        ),
        (_bodies.step_reading_w, "global W (tensor 2 torch.float32)"),
        (_bodies.step_reading_p, "global P (Parameter 2 torch.float32)"),
        (
            _bodies.step_with_tensor_default,
            "step_with_tensor_default default of parameter 'w' (tensor",
        ),
        (
            _bodies.make_nested_step(torch.ones(2)),
            "make_nested_step.<locals>.helper.__closure__ 'w' (tensor",
        ),
        (_bodies.make_module_step(TinyNet()), "__closure__ 'model' (nn.Module TinyNet holding 4"),
        (functools.partial(_bodies.scaled_step, scale=torch.ones(1)), "keywords['scale'] (tensor"),
    ],
    ids=[
        "closure",
        "global-tensor",
        "global-parameter",
        "default",
        "nested-helper",
        "module",
        "partial",
    ],
)
def test_frozen_state_is_refused_with_its_path(fn: Any, path: str) -> None:
    model, x, _ = inputs()
    with pytest.raises(FrozenStateError) as info:
        cadence.precompile(fn, (model, x))
    assert any(path in p for p in info.value.paths), info.value.paths
    assert "Pass them (or the module holding them) as arguments" in str(info.value)
    assert path in str(info.value)


def test_stateless_module_globals_and_arguments_are_not_frozen_state() -> None:
    assert _capture.capture(_bodies.step_with_stateless_global).frozen == []
    assert _capture.capture(step).frozen == []  # the model is an argument
    model = TinyNet()
    assert _capture.capture(model.forward).frozen == []  # the receiver is an argument


def test_the_function_and_its_package_have_two_names() -> None:
    """``cadence.precompile`` is a plain function and ``cadence.precompiling`` its package,
    in any import order; ``import cadence`` stays lazy."""
    code = (
        "import sys, types, cadence\n"
        "assert 'torch' not in sys.modules\n"  # import cadence stays lazy
        "fn = cadence.precompile\n"
        "assert isinstance(fn, types.FunctionType), type(fn)\n"
        "import cadence.precompiling as m\n"
        "assert isinstance(m, types.ModuleType) and type(m) is types.ModuleType\n"
        "assert cadence.precompile is fn is m.precompile and cadence.precompiling is m\n"
        "from cadence.precompiling import precompile_module, stats\n"
        "assert stats()['compiles'] == 0 and callable(precompile_module)\n"
        "import inspect; assert 'cache_dir' in inspect.signature(cadence.precompile).parameters\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
    assert {"precompile", "precompiling"} <= set(cadence.__all__)
    assert issubclass(PrecompileError, CadenceError) and issubclass(PrecompileError, RuntimeError)


def test_guard_text_is_made_readable() -> None:
    text = "L['model']._modules['1']._parameters['weight'] size mismatch"
    assert _function.describe_guard(text) == "model.1.weight size mismatch"


def test_key_fields_explain_a_difference() -> None:
    model, x, y = inputs()
    cap = _capture.capture(step)
    key = _key.build_key(
        step,
        (model, x, y),
        {},
        sources=cap.code,
        captured=cap.values,
        instance=cap.identity,
        options={"backend": "inductor"},
    )
    other = {**key.fields, "env": {**key.fields["env"], "torch": "9.9"}}
    other["sources"] = {**key.fields["sources"], "tests.precompiling._bodies.step": "0"}
    assert key.diff(key.fields) == []
    assert key.diff(other) == [
        'env.torch: artifact "9.9", here ' + f'"{torch.__version__}"',
        "source of tests.precompiling._bodies.step changed",
    ]
    assert key.fields["captured"]["global SCALE"] == "float:2.0"
    shorter = _key.build_key(
        step,
        (model, x[:2], y[:2]),
        {},
        sources=cap.code,
        captured=cap.values,
        instance=cap.identity,
        options={"backend": "inductor"},
    )
    assert shorter.slot != key.slot  # other input specs: another file


def test_factory_closures_get_their_own_slots() -> None:
    def make(k: float) -> Any:
        return lambda model, x: model(x) * k

    model, x, _ = inputs()
    keys = []
    for k in (1.0, 2.0):
        cap = _capture.capture(make(k))
        keys.append(
            _key.build_key(
                make(k),
                (model, x),
                {},
                sources=cap.code,
                captured=cap.values,
                instance=cap.identity,
                options={},
            )
        )
    assert keys[0].slot != keys[1].slot
