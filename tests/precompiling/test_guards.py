"""A call unlike the example inputs: a clear error naming the guard, or a local compile.

One compile serves every "raise" case; the "compile" mode loads that artifact from the
cache and compiles only the variants its calls need.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import cadence
from cadence.precompiling import (
    CacheRefusedWarning,
    GuardFailureError,
    LocalCompileWarning,
    stats,
)
from cadence.testing import assert_close
from tests.precompiling import _bodies
from tests.precompiling._bodies import BACKEND, inputs, loss_and_grads, step

pytestmark = pytest.mark.filterwarnings("ignore:Cannot locate reference")


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _scale(value: float) -> Iterator[None]:
    before = _bodies.SCALE
    _bodies.SCALE = value
    try:
        yield
    finally:
        _bodies.SCALE = before


def _call(compiled: Any, model: Any, x: Any, y: Any, ctx: Any = None) -> Any:
    with ctx if ctx is not None else _nothing():
        return compiled(model, x, y)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def test_guard_failures(tmp_path: Path) -> None:
    model, x, y = inputs()
    cache = tmp_path / "cache"
    compiled = cadence.precompile(step, (model, x, y), cache_dir=cache, backend=BACKEND)
    assert_close(loss_and_grads(compiled, model, x, y), loss_and_grads(step, model, x, y))
    threads = torch.get_num_threads()

    cases: dict[str, tuple[Callable[[], Any], str, str]] = {
        "shape": (
            lambda: compiled(model, torch.randn(5, 4), torch.randn(5, 2)),
            "tensor 'x' size mismatch at index 0. expected 3, actual 5",
            "shape differs",
        ),
        "dtype": (
            lambda: compiled(model, x.double(), y),
            "tensor 'x' dtype mismatch",
            "dtype differs",
        ),
        "requires_grad": (
            lambda: compiled(model, x.detach().requires_grad_(), y),
            "tensor 'x' requires_grad mismatch",
            "requires_grad differs",
        ),
        "grad mode": (
            lambda: _call(compiled, model, x, y, torch.no_grad()),
            "GLOBAL_STATE changed: grad_mode",
            "grad mode differs",
        ),
        "thread count": (
            lambda: _call(compiled, model, x, y, _threads(threads + 1)),
            "GLOBAL_STATE changed: num_threads",
            "get_num_threads() differs",
        ),
        "training flag": (
            lambda: compiled(model.eval(), x, y),
            "model.drop.training == True",
            "training flag differs",
        ),
        "captured global": (
            lambda: _call(compiled, model, x, y, _scale(3.0)),
            "captured global SCALE changed since precompile",
            "compiled code still holds the old value",
        ),
    }
    for case, (call, guard, hint) in cases.items():
        model.train()
        with pytest.raises(GuardFailureError) as info:
            call()
        message = str(info.value)
        assert guard in message and hint in message, (case, message)
        assert "on_guard_failure='compile'" in message
        assert any(guard in g for g in info.value.guards), (case, info.value.guards)


def test_on_guard_failure_compile(tmp_path: Path) -> None:
    model, x, y = inputs()
    cache = tmp_path / "cache"
    cadence.precompile(step, (model, x, y), cache_dir=cache, backend=BACKEND)
    before = stats()["compiles"]
    compiled = cadence.precompile(
        step, (model, x, y), cache_dir=cache, backend=BACKEND, on_guard_failure="compile"
    )
    assert compiled.source == "cache" and stats()["compiles"] == before

    x5, y5 = torch.randn(5, 4), torch.randn(5, 2)
    with pytest.warns(LocalCompileWarning, match="size mismatch"):
        got = loss_and_grads(compiled, model, x5, y5)
    assert_close(got, loss_and_grads(step, model, x5, y5))
    assert compiled.local_compiles == 1 and stats()["compiles"] == before + 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", LocalCompileWarning)  # both variants are kept
        assert_close(loss_and_grads(compiled, model, x5, y5), loss_and_grads(step, model, x5, y5))
        assert_close(loss_and_grads(compiled, model, x, y), loss_and_grads(step, model, x, y))

    # A changed global: the variants that baked the old value are dropped.
    with _scale(3.0):
        # The cached artifact for these inputs baked SCALE == 2.0: refused as stale.
        with (
            pytest.warns(CacheRefusedWarning, match="stale: captured value global SCALE"),
            pytest.warns(LocalCompileWarning, match="captured global SCALE changed"),
        ):
            got = loss_and_grads(compiled, model, x, y)
        assert_close(got, loss_and_grads(step, model, x, y))
    assert compiled.local_compiles == 2
