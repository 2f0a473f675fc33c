"""The cache key: what an artifact was compiled from, in named, comparable fields.

[Note: precompile cache key]
An artifact is only valid where everything that shaped it is the same:

* ``function``: module and qualname of the compiled function;
* ``inputs``: the example inputs' specs (tensor shape, stride when not contiguous,
  dtype, device, ``requires_grad``; module class, ``training`` flags, parameter and
  buffer specs, hook counts; the values of Python scalars, which Dynamo specializes on);
* ``state``: global state read while tracing (grad mode, autocast, thread count,
  default dtype, deterministic algorithms, float32 matmul precision, TF32 switches);
* ``options``: backend, ``dynamic``, ``mode``, ``options`` and the serializer path;
* ``env``: torch (version and git hash), Python (version, implementation, bytecode
  magic), cadence, machine and CPU ISA (torch's CPU capability and the ``/proc/cpuinfo``
  flags, because inductor compiles for the host's vector ISA), the C++ compiler, CUDA
  and GPU when a CUDA tensor is involved, and a digest of the dynamo/inductor configs;
* ``sources``: digests of every function and class the compiled code reaches (see
  `_capture`), so an edited helper or model class is a different artifact.

The file name (the *slot*) hashes only ``function``, ``inputs``, ``state`` and
``options``. A new torch or an edited source therefore lands in the same slot: the old
artifact there is refused by name (the warning says which field changed) and replaced,
instead of piling up next to it. The bytes of an artifact are never part of the key:
they are not deterministic (a uuid, timings, hash-seeded sets).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from cadence._util.version import __version__
from cadence.precompiling import _torch_aot

__all__ = ["FORMAT_VERSION", "Key", "build_key", "global_state", "input_spec"]

FORMAT_VERSION = 1
_SLOT_FIELDS = ("function", "inputs", "state", "options")
_STALE_FIELDS = ("sources", "captured")


def _digest(obj: Any, n: int = 32) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def _tensor_spec(t: torch.Tensor) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "shape": list(t.shape),
        "dtype": str(t.dtype),
        "device": str(t.device),
        "requires_grad": bool(t.requires_grad),
        "layout": str(t.layout),
    }
    if t.layout == torch.strided and not t.is_contiguous():
        spec["stride"] = list(t.stride())
    if isinstance(t, torch.nn.Parameter):
        spec["parameter"] = True
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        spec["type"] = f"{type(t).__module__}.{type(t).__qualname__}"
    return spec


def _module_spec(m: torch.nn.Module) -> dict[str, Any]:
    params = [[n, *_tensor_spec(p).values()] for n, p in m.named_parameters()]
    buffers = [[n, *_tensor_spec(b).values()] for n, b in m.named_buffers()]
    subs = list(m.modules())
    hooks = sum(
        len(s._forward_hooks) + len(s._forward_pre_hooks) + len(s._backward_hooks) for s in subs
    )
    return {
        "module": f"{type(m).__module__}.{type(m).__qualname__}",
        "training": _digest([s.training for s in subs], 16),
        "all_training": all(s.training for s in subs),
        "params": _digest(params),
        "buffers": _digest(buffers),
        "num_params": len(params),
        "hooks": hooks,
    }


def input_spec(value: Any, depth: int = 0) -> Any:
    """A JSON-able description of an input, as precise as the guards that check it."""
    if depth > 8:
        return {"type": type(value).__qualname__}
    if isinstance(value, torch.Tensor):
        return {"tensor": _tensor_spec(value)}
    if isinstance(value, torch.nn.Module):
        return _module_spec(value)
    if isinstance(value, (bool, int, float, complex, str, bytes, type(None))):
        return {type(value).__name__: repr(value)}
    if isinstance(value, (torch.dtype, torch.device)):
        return {type(value).__name__: str(value)}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [input_spec(v, depth + 1) for v in value]}
    if isinstance(value, Mapping):
        return {"dict": [[repr(k), input_spec(v, depth + 1)] for k, v in value.items()]}
    spec: dict[str, Any] = {"type": f"{type(value).__module__}.{type(value).__qualname__}"}
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict):
        spec["attrs"] = [[k, input_spec(v, depth + 1)] for k, v in sorted(attrs.items())]
    return spec


def global_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "num_threads": torch.get_num_threads(),
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
    }
    for device in ("cpu", "cuda"):
        enabled = torch.is_autocast_enabled(device)
        state[f"autocast_{device}"] = str(torch.get_autocast_dtype(device)) if enabled else None
    if torch.cuda.is_available():
        state["cuda_tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
        state["cudnn_tf32"] = bool(torch.backends.cudnn.allow_tf32)
    return state


@functools.cache
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = sorted(set(line.split(":", 1)[1].split()))
                    return hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16]
    except OSError:
        pass
    return "unknown"


@functools.cache
def _static_env() -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "python": platform.python_version(),
        "python_impl": sys.implementation.name,
        "bytecode": importlib.util.MAGIC_NUMBER.hex(),
        "cadence": __version__,
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": _cpu_flags(),
    }


def _device_env(devices: set[str], backend: str) -> dict[str, Any]:
    env: dict[str, Any] = {}
    if backend == "inductor" and (not devices or "cpu" in devices):
        env["cxx"] = _torch_aot.cxx_identity()
    if "cuda" in devices and torch.cuda.is_available():
        index = torch.cuda.current_device()
        env["cuda"] = torch.version.cuda or torch.version.hip
        env["gpu"] = torch.cuda.get_device_name(index)
        env["gpu_capability"] = list(torch.cuda.get_device_capability(index))
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    return env


def _devices(value: Any, out: set[str], depth: int = 0) -> None:
    if depth > 8:
        return
    if isinstance(value, torch.Tensor):
        out.add(value.device.type)
    elif isinstance(value, torch.nn.Module):
        for t in (*value.parameters(), *value.buffers()):
            out.add(t.device.type)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _devices(v, out, depth + 1)
    elif isinstance(value, Mapping):
        for v in value.values():
            _devices(v, out, depth + 1)


@dataclass
class Key:
    """Named fields (JSON-able) plus the two hashes derived from them."""

    fields: dict[str, Any]
    name: str = field(default="fn")

    @property
    def slot(self) -> str:
        return _digest({k: self.fields[k] for k in _SLOT_FIELDS}, 24)

    @property
    def digest(self) -> str:
        return _digest(self.fields, 64)

    def filename(self) -> str:
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in self.name)[:60]
        return f"{safe}-{self.slot}.cpc"

    def diff(self, other: Mapping[str, Any]) -> list[str]:
        """How ``other`` (an artifact's recorded fields) differs from this key, in words."""
        lines: list[str] = []
        for name in sorted(set(self.fields) | set(other)):
            here, there = self.fields.get(name), other.get(name)
            if here == there:
                continue
            if isinstance(here, dict) and isinstance(there, dict):
                for sub in sorted(set(here) | set(there)):
                    a, b = there.get(sub), here.get(sub)
                    if a == b:
                        continue
                    if name in _STALE_FIELDS:
                        what = "is new" if a is None else "is gone" if b is None else "changed"
                        noun = "source of" if name == "sources" else "captured value"
                        lines.append(f"{noun} {sub} {what}")
                    else:
                        lines.append(f"{name}.{sub}: artifact {_short(a)}, here {_short(b)}")
            else:
                lines.append(f"{name}: artifact {_short(there)}, here {_short(here)}")
        return lines

    def field_digests(self) -> dict[str, str]:
        """One short digest per field: what ranks compare to find who differs, and where."""
        return {k: _digest(v, 16) for k, v in sorted(self.fields.items())}


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def build_key(
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    sources: dict[str, str],
    captured: dict[str, str],
    instance: dict[str, str],
    options: dict[str, Any],
) -> Key:
    target = getattr(fn, "__func__", fn)
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", type(target).__qualname__)
    devices: set[str] = set()
    _devices((args, kwargs), devices)
    backend = str(options.get("backend"))
    fields = {
        "function": {"name": f"{module}.{qualname}", "instance": _digest(instance)},
        "inputs": input_spec({"args": list(args), "kwargs": dict(kwargs)}),
        "state": global_state(),
        "options": {**options, "serializer": _torch_aot.serializer()},
        "env": {
            **_static_env(),
            **_device_env(devices, backend),
            "compiler_config": _torch_aot.compiler_config_digest(),
        },
        "sources": dict(sorted(sources.items())),
        "captured": dict(sorted(captured.items())),
    }
    return Key(fields=fields, name=qualname)
