"""`precompile` and `precompile_module`: compile once, share with every rank, cache safely.

The steps of one call, on every rank of the group:

1. Validate the arguments, walk the function (`_capture`) and refuse frozen state:
   local checks, before any compile or collective, so a misuse fails on every rank at
   once and none hangs.
2. Open ``cache_dir`` (refused, never read, unless only this user controls it: see
   [Note: precompile cache key file]), read ``CADENCE_JOB_SECRET``, build the cache
   key (`_key`) and look the artifact up; a refused artifact is a warning, never an
   error.
3. One fixed-size vote (an all-reduce of the key's digest and four flags, the same
   bytes per rank at any world size): whether every rank hit the cache, built the
   same key, refused nothing and agrees on having a job secret. Only if not are the
   details gathered: every rank raises `RankMismatchError` naming the differing
   fields, or the refusal of the rank that refused its cache directory or its secret
   (see [Note: precompile refusals travel]), or which ranks lack the secret.
4. If every rank hit, each loads its own file (``source == "cache"``). Otherwise rank
   ``src`` compiles (or loads its hit) and broadcasts the artifact, signed with the
   job's secret ([Note: precompile transport key]); the others wait asleep (see
   [Note: precompile waiting ranks]), verify it and load it (``"received"``).

[Note: precompile refusals travel]
A misuse is refused before any collective, because every rank makes the same one. An
untrusted cache directory or a malformed ``CADENCE_JOB_SECRET`` is different: node-local
folders and environments differ, so one rank may refuse while the others go on to the
first collective and would wait there until the group's timeout. So such a refusal is
not raised at once: it rides in the first vote as a flag, the details follow in a
gather, and then every rank raises, the refusing rank its own error and the others the same type naming that rank. An untrusted
directory is raised, not skipped with a warning: the caller asked for a cache, and the
fix (a private folder) is theirs to make; compiling quietly without one would hide that
someone else can write where they keep code.
"""

from __future__ import annotations

import json
import os
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cadence._util import job_secret as _job_secret
from cadence.comm import EventLog
from cadence.errors import CadenceValueError, UntrustedPathError
from cadence.fsdp._trace import refusal, traced_forward
from cadence.precompiling._artifact import ArtifactCache, check, decode, encode
from cadence.precompiling._capture import Capture
from cadence.precompiling._errors import (
    ArtifactRefused,
    CacheRefusedWarning,
    PrecompileUsageError,
    RankMismatchError,
)
from cadence.precompiling._function import PrecompiledFunction, Variant
from cadence.precompiling._job import Artifact, Job
from cadence.precompiling._key import Key
from cadence.precompiling._share import Channel, default_group
from cadence.topology import ParallelGroups

__all__ = ["precompile", "precompile_module"]

# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------


def _validate(
    fn: Any,
    example_args: Any,
    example_kwargs: Any,
    on_guard_failure: Any,
    options: dict[str, Any],
    cache_dir: Any,
) -> None:
    if isinstance(fn, PrecompiledFunction):
        raise PrecompileUsageError(f"{fn!r} is already precompiled; pass the original function")
    if isinstance(fn, torch.nn.Module):
        raise PrecompileUsageError(
            f"precompile takes a function; for a module use "
            f"cadence.precompiling.precompile_module({type(fn).__name__}(...), example_args), "
            "which compiles its forward with the module as an argument"
        )
    if not callable(fn):
        raise PrecompileUsageError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(example_args, (tuple, list)):
        raise PrecompileUsageError(
            f"example_args must be a tuple of arguments, got {type(example_args).__name__} "
            "(write (x,) for a single argument)"
        )
    if example_kwargs is not None and not (
        isinstance(example_kwargs, dict) and all(isinstance(k, str) for k in example_kwargs)
    ):
        raise PrecompileUsageError("example_kwargs must be None or a dict with str keys")
    if on_guard_failure not in ("raise", "compile"):
        raise PrecompileUsageError(
            f"on_guard_failure must be 'raise' or 'compile', got {on_guard_failure!r}"
        )
    if not isinstance(options["backend"], str):
        raise PrecompileUsageError(
            "backend must be a registered backend name such as 'inductor' or 'aot_eager'; "
            "a callable backend cannot be part of a cache key or rebuilt on another rank"
        )
    if options["dynamic"] not in (None, True, False):
        raise PrecompileUsageError(
            f"dynamic must be None, True or False, got {options['dynamic']!r}"
        )
    if options["mode"] is not None and options["options"] is not None:
        raise PrecompileUsageError("pass mode or options, not both (torch.compile refuses both)")
    if options["options"] is not None and not isinstance(options["options"], dict):
        raise PrecompileUsageError("options must be a dict of inductor options")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise PrecompileUsageError(f"cache_dir must be a path, got {type(cache_dir).__name__}")


# ---------------------------------------------------------------------------------------
# The entry points
# ---------------------------------------------------------------------------------------


_REFUSALS: dict[str, type[Exception]] = {
    "UntrustedPathError": UntrustedPathError,
    "PrecompileUsageError": PrecompileUsageError,
}
_TRANSPORT_SIGNER = f"another job secret (is {_job_secret.ENV_VAR} the same on every rank?)"


def _agree(
    channel: Channel,
    key: Key,
    hit: bool,
    refused: tuple[str, Exception] | None,
    has_secret: bool,
) -> bool:
    """The first collective: whether every rank hit its cache; raises on every rank what
    any rank refused.

    ``refused`` is what this rank refused locally (its cache directory or its secret),
    raised only after the others heard of it: see [Note: precompile refusals travel].
    One fixed-size vote first ([Note: agreeing by digest] in ``cadence/comm.py``): the
    key's digest and four flags. The details (each field's digest, each refusal) are
    gathered only when the vote found a difference, to name the ranks and fields.
    """
    fields = key.field_digests()
    vote = channel.comm.agree(
        json.dumps(fields, sort_keys=True).encode(),
        flags=(refused is not None, not hit, has_secret, not has_secret),
    )
    some_refused, some_missed, some_secret, some_without = vote.raised
    if vote.same and not some_refused and not (some_secret and some_without):
        return not some_missed
    everyone = channel.gather(
        {
            "hit": hit,
            "fields": fields,
            "refused": None
            if refused is None
            else [refused[0], type(refused[1]).__name__, str(refused[1])],
            "secret": has_secret,
        }
    )
    if refused is not None:
        raise refused[1]
    for rank, e in enumerate(everyone):
        if e["refused"] is not None:
            what, kind, message = e["refused"]
            raise _REFUSALS.get(kind, PrecompileUsageError)(
                f"group rank {rank} refused its {what}: {message}"
            )
    with_secret = [r for r, e in enumerate(everyone) if e["secret"]]
    if 0 < len(with_secret) < len(everyone):
        without = [r for r, e in enumerate(everyone) if not e["secret"]]
        raise PrecompileUsageError(
            f"precompile({key.name}): {_job_secret.ENV_VAR} is set on group ranks "
            f"{with_secret} but not on {without}, so they cannot agree on the key that "
            f"signs the artifact; {_job_secret.FIX}"
        )
    reference = everyone[channel.src]["fields"]
    differing = {
        rank: sorted(
            f for f in set(e["fields"]) | set(reference) if e["fields"].get(f) != reference.get(f)
        )
        for rank, e in enumerate(everyone)
        if e["fields"] != reference
    }
    if differing:
        detail = "; ".join(f"rank {r}: {', '.join(fs)}" for r, fs in differing.items())
        raise RankMismatchError(
            f"precompile({key.name}): ranks built different compile keys than rank "
            f"{channel.src} (group ranks; differing fields: {detail}). Every rank must call "
            "precompile with the same function, input specs, global state and environment."
        )
    return all(e["hit"] for e in everyone)


def precompile(
    fn: Callable[..., Any],
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    group: dist.ProcessGroup | ParallelGroups | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    src: int = 0,
    on_guard_failure: str = "raise",
    backend: str = "inductor",
    dynamic: bool | None = None,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    ship_kernels: bool = True,
    event_log: EventLog | None = None,
) -> PrecompiledFunction:
    """Compile ``fn`` ahead of time once per group, load it on every rank, cache it safely.

    Args:
        fn: the step (a function, bound method or ``functools.partial``), traced whole
            (``fullgraph``): models, optimizers' tensors and data must be *arguments*.
        example_args, example_kwargs: inputs like those of the real calls.
        group: the ranks sharing one compile: a process group, a `ParallelGroups`
            (its data-parallel group: one compile per pipeline stage), or None (the
            world if torch.distributed is initialized, else this process alone).
        cache_dir: a directory for signed artifacts, which only you may write (else
            `UntrustedPathError`, naming the fix, on every rank); see
            docs/precompile.md.
        src: the group rank that compiles.
        on_guard_failure: ``"raise"`` a `GuardFailureError` naming the guard when a
            call differs from the example inputs, or ``"compile"`` a new variant on
            that rank alone.
        backend, dynamic, mode, options: passed to ``torch.compile`` (part of the key).
        ship_kernels: bundle the C++ kernels inductor built with the artifact, so a
            node whose inductor cache lacks them skips the C++ build when loading.
        event_log: records this call's collectives.

    Returns:
        A `PrecompiledFunction` whose ``.source`` says where it came from.
    """
    opts = {"backend": backend, "dynamic": dynamic, "mode": mode, "options": options}
    _validate(fn, example_args, example_kwargs, on_guard_failure, opts, cache_dir)
    if isinstance(group, ParallelGroups):
        group = group.dp
    if group is None:
        group = default_group()
    elif not dist.is_initialized():
        raise PrecompileUsageError("group was given but torch.distributed is not initialized")
    channel = None
    if group is not None and dist.get_rank(group) < 0:
        raise PrecompileUsageError(
            f"rank {dist.get_rank()} is not a member of the group it passed to precompile"
        )
    if group is not None and dist.get_world_size(group) > 1:
        channel = Channel(group, src, event_log)
    world = 1 if channel is None else channel.world_size
    if not isinstance(src, int) or not 0 <= src < world:
        raise PrecompileUsageError(f"src must be a group rank in [0, {world}), got {src!r}")
    cache, refused = _open_cache(cache_dir)
    secret = None
    if channel is not None and refused is None:
        try:
            secret = _job_secret.from_env()
        except CadenceValueError as exc:
            refused = ("job secret", PrecompileUsageError(f"precompile: {exc}"))
    if refused is not None and channel is None:
        raise refused[1]
    job = Job(fn, opts, cache, ship_kernels=bool(ship_kernels))
    args = (*job.bound, *example_args)
    kwargs = dict(example_kwargs or {})
    _refuse_fully_shard(job.name, args, kwargs)
    key, cap = job.key(args, kwargs)
    found = job.lookup(key)

    if channel is None:
        if found is not None:
            variant, source, _ = job.load_or_compile(found, key, args, kwargs, cap, "cache")
        else:
            variant, source = job.compile_and_save(key, args, kwargs, cap)[0], "compiled"
    else:
        all_hit = _agree(channel, key, found is not None, refused, secret is not None)
        if found is not None and all_hit:
            variant, source, _ = job.load_or_compile(found, key, args, kwargs, cap, "cache")
        else:
            signing = secret if secret is not None else channel.group_secret()
            if channel.rank == src:
                variant, source = _send(channel, signing, job, key, found, args, kwargs, cap)
            else:
                variant, source = _receive(channel, signing, job, key, found, args, kwargs, cap)
    return PrecompiledFunction(
        fn,
        job.bound,
        variant,
        source=source,
        on_guard_failure=on_guard_failure,
        recompile=job.recompile,
        timings=job.timings,
        cache_path=str(cache.path(key)) if cache is not None else None,
    )


def _open_cache(
    cache_dir: str | os.PathLike[str] | None,
) -> tuple[ArtifactCache | None, tuple[str, Exception] | None]:
    """The cache, or None; and the refusal of an untrusted directory, to be raised on
    every rank (see [Note: precompile refusals travel])."""
    if cache_dir is None:
        return None, None
    try:
        return ArtifactCache(cache_dir), None
    except UntrustedPathError as exc:
        return None, ("cache", exc)
    except OSError as exc:  # a read-only or missing disk: compile without a cache
        warnings.warn(
            f"precompile: cache directory {cache_dir} is unusable ({exc}); not caching",
            CacheRefusedWarning,
            stacklevel=3,
        )
        return None, None


def _refuse_fully_shard(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Local, before any collective: see [Note: precompiling a fully_shard forward]."""
    for what, value in [
        *((f"argument {i}", a) for i, a in enumerate(args)),
        *((f"argument {k!r}", v) for k, v in kwargs.items()),
    ]:
        why = refusal(value, what)
        if why is not None:
            raise PrecompileUsageError(f"precompile({name}): {why}.")


def _send(
    channel: Channel,
    signing: bytes,
    job: Job,
    key: Key,
    found: Artifact | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cap: Capture,
) -> tuple[Variant, str]:
    result: list[tuple[Variant, str]] = []

    def produce() -> bytes:
        if found is not None:
            variant, source, (header, sections) = job.load_or_compile(
                found, key, args, kwargs, cap, "cache"
            )
        else:
            variant, header, sections = job.compile_and_save(key, args, kwargs, cap)
            source = "compiled"
        result.append((variant, source))
        return encode(header, sections, signing)

    channel.send(produce)
    return result[0]


def _receive(
    channel: Channel,
    signing: bytes,
    job: Job,
    key: Key,
    found: Artifact | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cap: Capture,
) -> tuple[Variant, str]:
    start, cpu = time.perf_counter(), time.process_time()
    data = channel.receive()
    job.timings["wait_s"] = time.perf_counter() - start
    job.timings["wait_cpu_s"] = time.process_time() - cpu
    if found is not None:  # a hit of our own (a node-local cache): no need for theirs
        return job.load_or_compile(found, key, args, kwargs, cap, "cache")[:2]
    try:
        received = check(decode(data, signing, other_key=_TRANSPORT_SIGNER), key)
    except ArtifactRefused as exc:
        why = f"the artifact rank {channel.src} sent was refused ({exc.reason})"
        return job.compile_here(why, key, args, kwargs, cap)[:2]
    variant, source, _ = job.load_or_compile(received, key, args, kwargs, cap, "received")
    if source == "received":
        _refresh(job, key, received)
    return variant, source


def _refresh(job: Job, key: Key, received: Artifact) -> None:
    """A rank that received an artifact writes it to its cache unless a valid one is there
    already (a shared directory that ``src`` just wrote): node-local caches fill up too."""
    if job.cache is None:
        return
    try:
        if job.cache.read(key) is not None:
            return
    except (ArtifactRefused, OSError):
        pass
    header, sections = received
    job.write(key, header, sections)


def precompile_module(
    module: torch.nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> PrecompiledFunction:
    """Precompile ``module``'s forward and install it as ``module.forward``.

    The class's ``forward`` is compiled with the module as its first argument, so the
    parameters stay live (optimizer updates are seen, gradients reach them). Calling
    ``module(...)`` then runs the module's hooks eagerly around the compiled forward;
    a wrapper such as `cadence.DataParallel` keeps doing its work outside the graph.
    ``del module.forward`` restores the eager forward. Keyword arguments are those of
    `precompile`.

    A `cadence.fully_shard` module is compiled as its forward sees it: unsharded for
    the compile (an all-gather: call it on every rank of the shard group together,
    between steps), with ``example_args`` cast as its mixed-precision policy casts
    forward inputs, and left sharded or unsharded as it was. A module holding nested
    fully_shard units is refused: precompile each innermost unit (e.g. each block)
    instead. See [Note: precompiling a fully_shard forward] in ``cadence/fsdp/_trace.py``.
    """
    if not isinstance(module, torch.nn.Module):
        raise PrecompileUsageError(f"module must be an nn.Module, got {type(module).__name__}")
    if "forward" in vars(module):
        raise PrecompileUsageError(
            f"{type(module).__name__}.forward is already replaced on this instance "
            "(precompiled already?); `del module.forward` first"
        )
    why = refusal(module, "the module", forward_only=True)
    if why is not None:
        raise PrecompileUsageError(f"precompile_module: {why}.")
    with traced_forward(module, example_args, example_kwargs or {}) as (a, kw):
        compiled = precompile(types.MethodType(type(module).forward, module), a, kw, **kwargs)
    module.forward = compiled
    return compiled
