"""cadence.precompile: compile a step once, share it with every rank, cache it safely.

``cadence.precompile(fn, example_args)`` compiles ``fn`` ahead of time (``fullgraph``)
on one rank of the group, sends the artifact to the others (which wait without spinning
a core) and loads it everywhere; with ``cache_dir`` the artifact is kept in a signed,
versioned file whose header is checked before anything is unpickled. See
docs/precompile.md for the guarantees, the cache key and the torch versions supported.

Module layout (one concern each): `_api` (the entry points), `_capture` (what a function
reaches: frozen state, code digests, watched values), `_key` (the cache key),
`_artifact` (file format, signing, the cache directory), `_share` (the collectives),
`_job` (one call's compile, load and cache steps), `_kernels` (the C++ kernel bundle),
`_function` (the returned callable and its guard errors), `_torch_aot` (every use of
torch internals, behind a feature test), `_errors`. The job secret that signs what
ranks send each other is `cadence._util.job_secret`; the ownership checks of the cache
directory are `cadence._util.owned`.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

from cadence.errors import UntrustedPathError
from cadence.precompile._api import precompile, precompile_module
from cadence.precompile._errors import (
    CacheRefusedWarning,
    FrozenStateError,
    GuardFailureError,
    LocalCompileWarning,
    PrecompileError,
    PrecompileUsageError,
    RankMismatchError,
)
from cadence.precompile._function import PrecompiledFunction
from cadence.precompile._job import reset_stats, stats
from cadence.precompile._torch_aot import SERIALIZER, SERIALIZER_REASON

__all__ = [
    "SERIALIZER",
    "SERIALIZER_REASON",
    "CacheRefusedWarning",
    "FrozenStateError",
    "GuardFailureError",
    "LocalCompileWarning",
    "PrecompileError",
    "PrecompileUsageError",
    "PrecompiledFunction",
    "RankMismatchError",
    "UntrustedPathError",
    "precompile",
    "precompile_module",
    "reset_stats",
    "stats",
]


class _CallableModule(types.ModuleType):
    """``cadence.precompile`` is both this package and its main function.

    A function exported under the package's own name would be replaced by the package
    object as soon as anything runs ``import cadence.precompile`` (the import system binds
    submodules as attributes of their parent), so the package itself is callable:
    ``cadence.precompile(fn, args)``, ``cadence.precompile.stats()`` and
    ``from cadence.precompile import precompile`` all work, in any import order.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> PrecompiledFunction:
        return precompile(*args, **kwargs)


_module = sys.modules[__name__]
_module.__class__ = _CallableModule
_module.__signature__ = inspect.signature(precompile)  # type: ignore[attr-defined]  # ModuleType has no __signature__; inspect reads it
