"""What a call came to, as data: a test body records it and the test asserts on it.

A rank body cannot fail one pytest test by itself, so it records each call's
outcome as plain data (`recorded`, `raised`) and the test module holds what is
expected of it (`assert_returned`, `assert_refused`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cadence

REFUSED = "refused: "


def recorded(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or the exception it raised as text: one failing case fails one test."""
    try:
        return fn(*args)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def raised(fn: Callable[[], object]) -> str | None:
    """What ``fn()`` raised, as text; ``None`` when it returned.

    A cadence error reads ``"refused: <message>"`` and any other exception
    ``"<type>: <message>"``, so a test tells cadence's refusal from an error that
    escaped (torch's own, say). Safe inside an autograd hook: nothing propagates.
    """
    try:
        fn()
    except cadence.CadenceError as exc:
        return f"{REFUSED}{exc}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def assert_returned(outcome: str | None) -> None:
    """The call recorded by `raised` returned: it raised nothing."""
    assert outcome is None, f"expected the call to return; got {outcome}"


def assert_refused(outcome: str | None, *fragments: str) -> None:
    """The call recorded by `raised` raised a cadence error naming every fragment."""
    assert outcome is not None, f"expected a cadence error naming {list(fragments)}; none raised"
    assert outcome.startswith(REFUSED), f"expected a cadence error; got {outcome}"
    message = outcome.removeprefix(REFUSED)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"the error does not name {missing}: {message}"
