"""What a call came to, as data: a test body records it and the test asserts on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def recorded(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or the exception it raised as text: one failing case fails one test."""
    try:
        return fn(*args)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
