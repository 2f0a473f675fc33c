"""`PrecompiledFunction`: the callable `cadence.precompile` returns.

A call checks, in order: the values the function captured (globals and closure cells,
see `_capture`), then each compiled variant's guards; the first variant whose guards
pass runs. torch's own guard check is disabled on every variant, so the guards run
once per call. When nothing matches, the call raises `GuardFailureError` naming the
failed guard, or, with ``on_guard_failure="compile"``, compiles a variant for this
call on this rank alone (no collective: a guard may fail on one rank only) and runs it.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cadence.precompiling import _torch_aot
from cadence.precompiling._capture import Capture
from cadence.precompiling._errors import GuardFailureError, LocalCompileWarning

__all__ = ["PrecompiledFunction", "Variant", "describe_guard"]


@dataclass
class Variant:
    """One compiled function and the captured values it baked in."""

    aot: Any
    capture: Capture


_HINTS = [
    (
        "size mismatch",
        "a tensor's shape differs from the example inputs (precompile each "
        "shape, or pass dynamic=True)",
    ),
    ("stride mismatch", "a tensor's memory layout (strides) differs from the example inputs"),
    ("dtype mismatch", "a tensor's dtype differs from the example inputs"),
    ("device mismatch", "a tensor's device differs from the example inputs"),
    ("requires_grad mismatch", "a tensor's requires_grad differs from the example inputs"),
    ("grad_mode", "grad mode differs from compile time (torch.no_grad() / enable_grad())"),
    ("num_threads", "torch.get_num_threads() differs from compile time"),
    ("autocast", "autocast state differs from compile time"),
    ("default_dtype", "torch.get_default_dtype() differs from compile time"),
    ("deterministic", "torch.use_deterministic_algorithms differs from compile time"),
    (".training", "a module's training flag differs (model.train() / model.eval())"),
    (
        "captured",
        "a global or closure value the function read when it was compiled has "
        "changed; the compiled code still holds the old value",
    ),
    ("signature", "the call does not bind to the function's parameters"),
]


def describe_guard(guard: str) -> str:
    """torch's guard text with readable names: ``L['model']._modules['1'].training``
    becomes ``model.1.training``."""
    text = re.sub(r"L\['([^']+)'\]", r"\1", guard)
    text = re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", text)
    return text


def _hint(guard: str) -> str:
    for needle, hint in _HINTS:
        if needle in guard:
            return hint
    return "an input or global state differs from the example inputs"


class PrecompiledFunction:
    """A compiled ``fn``, loaded or compiled on this rank; call it like ``fn``.

    Attributes:
        source: ``"compiled"`` (this rank compiled it), ``"received"`` (loaded from the
            bytes another rank compiled) or ``"cache"`` (loaded from ``cache_dir``).
        timings: seconds spent on this rank: ``compile_s``, ``load_s``, ``wait_s``
            (waiting for another rank), and ``bytes`` of the artifact.
        local_compiles: variants this rank compiled after a guard failure.
        cache_path: the artifact's file, when a cache directory is used.
        serializer: ``"cadence"`` or ``"torch"`` (see the docs' torch-version table).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        bound: tuple[Any, ...],
        variant: Variant,
        *,
        source: str,
        on_guard_failure: str,
        recompile: Callable[[tuple[Any, ...], dict[str, Any]], Variant],
        timings: dict[str, float],
        cache_path: str | None,
    ) -> None:
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.source = source
        self.timings = timings
        self.cache_path = cache_path
        self.serializer = _torch_aot.serializer()
        self.local_compiles = 0
        self._bound = bound
        self._variants = [variant]
        self._on_guard_failure = on_guard_failure
        self._recompile = recompile

    def __repr__(self) -> str:
        return f"<PrecompiledFunction {self.__qualname__} source={self.source!r}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        full = (*self._bound, *args)
        stale = self._variants[0].capture.changed()
        if not stale:
            for variant in self._variants:
                if _torch_aot.guard_ok(variant.aot, full, kwargs):
                    return _torch_aot.call(variant.aot, full, kwargs)
            failed = _torch_aot.guard_failures(self._variants[0].aot, full, kwargs)
        else:
            failed = [f"captured {label} changed since precompile" for label in stale]
        if self._on_guard_failure == "raise":
            raise self._error(failed)
        variant = self._recompile(full, kwargs)
        warnings.warn(
            f"precompiled {self.__qualname__}: {describe_guard(failed[0])}; compiled a new "
            "variant on this rank only (on_guard_failure='compile')",
            LocalCompileWarning,
            stacklevel=2,
        )
        self.local_compiles += 1
        if stale:
            # The old variants baked in the old values: none of them may run again.
            self._variants = [variant]
        else:
            self._variants.append(variant)
        return _torch_aot.call(variant.aot, full, kwargs)

    def _error(self, failed: list[str]) -> GuardFailureError:
        shown = [describe_guard(g) for g in failed]
        lines = "\n".join(f"  - {g}: {_hint(g)}" for g in shown[:5])
        return GuardFailureError(
            f"precompiled {self.__qualname__} (source={self.source}) does not match this "
            f"call; failed guard(s):\n{lines}\nCall it with inputs and state like the example "
            "inputs, precompile this variant too, or pass on_guard_failure='compile' to "
            "compile it on this rank when it happens.",
            shown,
        )
