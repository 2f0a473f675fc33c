"""One precompile call's work on one rank: key, compile, serialize, cache, load.

`Job` holds what a call needs (the function, the compile options, the cache) and does
each step once; `cadence.precompiling._api` decides, per rank, which steps run. The
counters behind `stats` live here, next to the work they count.
"""

from __future__ import annotations

import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from cadence.precompiling import _kernels, _torch_aot
from cadence.precompiling._artifact import ArtifactCache, make_header
from cadence.precompiling._capture import Capture, capture, frozen_in, module_class_digests
from cadence.precompiling._errors import (
    ArtifactRefused,
    CacheRefusedWarning,
    FrozenStateError,
    PrecompileError,
)
from cadence.precompiling._function import Variant
from cadence.precompiling._key import Key, build_key

__all__ = ["Artifact", "Job", "reset_stats", "stats"]

Artifact = tuple[dict[str, Any], dict[str, bytes]]  # (header, sections)

_STATS = {"compiles": 0, "loads": 0, "cache_hits": 0, "cache_refused": 0, "cache_writes": 0}


def stats() -> dict[str, int]:
    """Counters of this process: compiles, loads, cache hits, refusals and writes."""
    return dict(_STATS)


def reset_stats() -> None:
    for name in _STATS:
        _STATS[name] = 0


def _split(fn: Callable[..., Any]) -> tuple[Any, tuple[Any, ...]]:
    """The function torch compiles and the leading arguments it is called with.

    A bound method compiles its function with the receiver as the first argument: the
    receiver (a module, say) stays live instead of being pickled into the artifact.
    """
    if isinstance(fn, types.MethodType):
        return fn.__func__, (fn.__self__,)
    return fn, ()


def _refuse_frozen(name: str, paths: list[str]) -> None:
    if paths:
        shown = "\n".join(f"  - {p}" for p in paths[:10])
        raise FrozenStateError(
            f"precompile({name}): tensors reached through a closure, a global or a default "
            f"would be frozen into the artifact (the loaded function would compute with a "
            f"copy that no optimizer step updates and no gradient reaches):\n{shown}\n"
            "Pass them (or the module holding them) as arguments of the function instead.",
            paths,
        )


def _sources(cap: Capture, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, str]:
    modules = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.nn.Module)]
    return {**cap.code, **module_class_digests(modules)}


# ---------------------------------------------------------------------------------------
# Compile, serialize, load
# ---------------------------------------------------------------------------------------


class Job:
    """Everything one precompile call needs to compile, load and cache its function."""

    def __init__(
        self,
        fn: Callable[..., Any],
        options: dict[str, Any],
        cache: ArtifactCache | None,
        ship_kernels: bool = True,
    ) -> None:
        self.fn = fn
        self.ship_kernels = ship_kernels
        self.kernel_keys: set[str] = set()
        self.kernel_files: set[str] = set()
        self.target, self.bound = _split(fn)
        self.name = getattr(self.target, "__qualname__", type(self.target).__name__)
        self.options = options
        self.cache = cache
        self.timings: dict[str, float] = {
            "compile_s": 0.0,
            "compile_cpu_s": 0.0,
            "load_s": 0.0,
            "wait_s": 0.0,
            "wait_cpu_s": 0.0,
        }

    def key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Key, Capture]:
        cap = capture(self.fn)
        _refuse_frozen(self.name, cap.frozen)
        key = build_key(
            self.target,
            args,
            kwargs,
            sources=_sources(cap, args, kwargs),
            captured=cap.values,
            instance=cap.identity,
            options=self.options,
        )
        return key, cap

    def compile(self, args: tuple[Any, ...], kwargs: dict[str, Any], cap: Capture) -> Variant:
        start, cpu = time.perf_counter(), time.process_time()
        known = _torch_aot.cpp_kernel_keys()
        inductor_dir = _torch_aot.inductor_cache_dir() if self.ship_kernels else ""
        on_disk = _kernels.snapshot(inductor_dir) if self.ship_kernels else set()
        try:
            aot = _torch_aot.aot_compile(self.target, args, kwargs, **self.options)
        except Exception as exc:
            raise PrecompileError(
                f"compiling {self.name} failed: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self.timings["compile_s"] += time.perf_counter() - start
            self.timings["compile_cpu_s"] += time.process_time() - cpu
        _STATS["compiles"] += 1
        self.kernel_keys = _torch_aot.cpp_kernel_keys() - known
        if self.ship_kernels:
            self.kernel_files = _kernels.snapshot(inductor_dir) - on_disk
        # What torch actually put in the artifact: a backstop for paths the walk missed.
        _refuse_frozen(self.name, frozen_in(_torch_aot.runtime_captures(aot)))
        return Variant(_torch_aot.prepare(aot), cap)

    def sections(self, variant: Variant, key: Key) -> tuple[dict[str, Any], dict[str, bytes]]:
        header = make_header(
            key,
            traced=_torch_aot.traced_sources(variant.aot),
            serializer=_torch_aot.serializer(),
        )
        try:
            data = _torch_aot.serialize(variant.aot)
        except Exception as exc:
            raise PrecompileError(
                f"serializing {self.name} failed: {type(exc).__name__}: {exc}"
            ) from exc
        sections = {"artifact": data}
        if self.ship_kernels and (self.kernel_keys or self.kernel_files):
            files = _kernels.files_for(
                self.kernel_keys, _torch_aot.inductor_cache_dir(), self.kernel_files
            )
            if files:
                sections["kernels"] = _kernels.pack(files)
                header["kernels"] = sorted(files)
        self.timings["bytes"] = float(sum(len(b) for b in sections.values()))
        return header, sections

    def load(self, sections: dict[str, bytes], cap: Capture) -> Variant:
        start = time.perf_counter()
        if "kernels" in sections:
            try:
                written = _kernels.unpack(sections["kernels"], _torch_aot.inductor_cache_dir())
                self.timings["kernels_written"] = float(written)
            except (OSError, ValueError) as exc:  # the kernels get built instead
                warnings.warn(
                    f"precompile({self.name}): shipped kernels not installed ({exc})",
                    CacheRefusedWarning,
                    stacklevel=4,
                )
        try:
            aot = _torch_aot.deserialize(sections["artifact"])
        finally:
            self.timings["load_s"] += time.perf_counter() - start
        _STATS["loads"] += 1
        return Variant(aot, cap)

    def write(self, key: Key, header: dict[str, Any], sections: dict[str, bytes]) -> None:
        if self.cache is None:
            return
        try:
            self.cache.write(key, header, sections)
            _STATS["cache_writes"] += 1
        except OSError as exc:
            warnings.warn(
                f"precompile({self.name}): could not write {self.cache.path(key)}: {exc}",
                CacheRefusedWarning,
                stacklevel=4,
            )

    def lookup(self, key: Key) -> Artifact | None:
        if self.cache is None:
            return None
        try:
            found = self.cache.read(key)
        except ArtifactRefused as exc:
            _STATS["cache_refused"] += 1
            warnings.warn(
                f"precompile({self.name}): refused {self.cache.path(key)}: {exc.reason}; "
                "compiling again",
                CacheRefusedWarning,
                stacklevel=4,
            )
            return None
        except OSError as exc:
            warnings.warn(
                f"precompile({self.name}): cannot read {self.cache.path(key)}: {exc}",
                CacheRefusedWarning,
                stacklevel=4,
            )
            return None
        if found is not None:
            _STATS["cache_hits"] += 1
        return found

    def compile_and_save(
        self, key: Key, args: tuple[Any, ...], kwargs: dict[str, Any], cap: Capture
    ) -> tuple[Variant, dict[str, Any], dict[str, bytes]]:
        variant = self.compile(args, kwargs, cap)
        header, sections = self.sections(variant, key)
        self.write(key, header, sections)
        return variant, header, sections

    def load_or_compile(
        self,
        found: Artifact,
        key: Key,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        cap: Capture,
        source: str,
    ) -> tuple[Variant, str, Artifact]:
        """Load a verified artifact; if torch still cannot load it, compile here instead.

        Returns the variant, where it came from, and the artifact it came from (the new
        one after a fallback compile: that is the one worth sending to other ranks).
        """
        try:
            return self.load(found[1], cap), source, found
        except Exception as exc:
            why = f"a verified artifact ({source}) failed to load ({type(exc).__name__}: {exc})"
            return self.compile_here(why, key, args, kwargs, cap)

    def compile_here(
        self,
        why: str,
        key: Key,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        cap: Capture,
    ) -> tuple[Variant, str, Artifact]:
        """Warn why, then compile on this rank alone (no collective)."""
        warnings.warn(
            f"precompile({self.name}): {why}; compiling on this rank instead",
            CacheRefusedWarning,
            stacklevel=4,
        )
        variant, header, sections = self.compile_and_save(key, args, kwargs, cap)
        return variant, "compiled", (header, sections)

    def recompile(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Variant:
        """A guard failed with on_guard_failure='compile': this rank compiles this call."""
        key, cap = self.key(args, kwargs)
        found = self.lookup(key)
        if found is not None:
            return self.load_or_compile(found, key, args, kwargs, cap, "cache")[0]
        return self.compile_and_save(key, args, kwargs, cap)[0]
