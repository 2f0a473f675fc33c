"""cadence.precompiling: compile a step once, share it with every rank, cache it safely.

The package is ``precompiling`` and its main function ``cadence.precompile`` (also
``cadence.precompiling.precompile``): a function and a package of one name would
clash, since importing a package binds it as an attribute of its parent.
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

from cadence.errors import UntrustedPathError
from cadence.precompiling._api import precompile, precompile_module
from cadence.precompiling._errors import (
    CacheRefusedWarning,
    FrozenStateError,
    GuardFailureError,
    LocalCompileWarning,
    PrecompileError,
    PrecompileUsageError,
    RankMismatchError,
)
from cadence.precompiling._function import PrecompiledFunction
from cadence.precompiling._job import reset_stats, stats
from cadence.precompiling._torch_aot import SERIALIZER, SERIALIZER_REASON

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
