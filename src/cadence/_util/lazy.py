"""Lazy attribute tables for packages whose submodules need torch.

``import cadence`` (and ``import cadence.pipeline``) must stay cheap and must work
where torch is not installed, so the torch-free schedule layer and the pickler are
usable there. A package lists ``name -> "module:attribute"`` (or ``"module"`` for a
submodule) and installs `lazy_getattr` as its module ``__getattr__``; a name is
imported on first use and cached in the package's namespace.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod


def lazy_getattr(
    package: str,
    table: Mapping[str, str],
    namespace: dict[str, Any],
) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving ``table`` lazily."""

    def __getattr__(name: str) -> Any:
        if name in table:
            value = _resolve(table[name])
            namespace[name] = value  # later lookups skip __getattr__
            return value
        # A subpackage reached as an attribute (``cadence.fsdp.x``) without an import
        # statement: eager packages allowed it, so a lazy one must too.
        if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}"):
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
