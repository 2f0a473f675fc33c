"""Lazy attribute tables for packages whose submodules need torch.

``import cadence`` (and ``import cadence.pipeline``) must stay cheap and must work
where torch is not installed, so the torch-free schedule layer and the pickler are
usable there. A package lists ``name -> "module:attribute"`` (or ``"module"`` for a
submodule) and installs `lazy_getattr` as its module ``__getattr__``; a name is
imported on first use and cached in the package's namespace.

`moved` serves names that moved: the old spelling keeps working for a deprecation
period and warns with the new location. `alias_moved_modules` does the same for
whole modules, so ``import old.module`` and ``from old.module import name`` keep
working after a module moved.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["alias_moved_modules", "lazy_getattr", "moved"]


def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod


def lazy_getattr(
    package: str,
    table: Mapping[str, str],
    namespace: dict[str, Any],
    moved_names: Mapping[str, str] | None = None,
) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving ``table`` lazily and ``moved_names`` with a warning."""

    def __getattr__(name: str) -> Any:
        if name in table:
            value = _resolve(table[name])
            namespace[name] = value  # later lookups skip __getattr__
            return value
        if moved_names and name in moved_names:
            return moved(f"{package}.{name}", moved_names[name])
        # A subpackage reached as an attribute (``cadence.fsdp.x``) without an import
        # statement: eager packages allowed it, so a lazy one must too.
        if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}"):
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def moved(old: str, new: str) -> Any:
    """Resolve ``new`` ("module:attribute") and warn that ``old`` is deprecated."""
    warnings.warn(
        f"{old} moved to {new.replace(':', '.')}; the old name will be removed in a later release",
        DeprecationWarning,
        stacklevel=3,
    )
    return _resolve(new)


class _MovedModuleLoader(importlib.abc.Loader):
    """Creates the deprecated module: a proxy whose attributes are the new module's."""

    def __init__(self, old: str, new: str, names: Mapping[str, str]) -> None:
        self.old, self.new, self.names = old, new, names

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(
            f"module {self.old} moved to {self.new}; the old name will be removed in a "
            "later release",
            DeprecationWarning,
            stacklevel=2,
        )
        target, names = importlib.import_module(self.new), self.names
        proxy = types.ModuleType(self.old, f"Deprecated alias of {self.new}.")

        def __getattr__(name: str) -> Any:
            # A name that left the module with it resolves to its own new home.
            if name in names:
                return _resolve(names[name])
            return getattr(target, name)

        def __dir__() -> list[str]:
            return sorted(set(dir(target)) | set(names))

        proxy.__getattr__ = __getattr__  # type: ignore[method-assign]
        proxy.__dir__ = __dir__  # type: ignore[method-assign]
        return proxy

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the proxy forwards every lookup."""


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def __init__(self, table: Mapping[str, tuple[str, Mapping[str, str]]]) -> None:
        self.table = dict(table)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.table:
            return None
        new, names = self.table[fullname]
        return importlib.util.spec_from_loader(fullname, _MovedModuleLoader(fullname, new, names))


def alias_moved_modules(table: Mapping[str, tuple[str, Mapping[str, str]]]) -> None:
    """Keep ``import old.module`` working: ``{old: (new module, {name: "module:attr"})}``.

    Importing an old module warns (`DeprecationWarning`, once per process) and gives
    a proxy whose attributes are those of the new module, so ``old.name is
    new.name``; the mapping names the few attributes that moved somewhere else. The
    finder sits at the end of ``sys.meta_path``, so it is asked only for modules no
    file provides any more. Installing the same table twice is a no-op.
    """
    for finder in sys.meta_path:
        if isinstance(finder, _MovedModuleFinder) and finder.table == dict(table):
            return
    sys.meta_path.append(_MovedModuleFinder(table))
