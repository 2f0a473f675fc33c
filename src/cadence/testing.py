"""A public test harness for distributed code, used by cadence's own tests.

- `run_distributed` runs a test body on N gloo ranks with one intra-op thread per
  rank and a hard timeout, so a hang fails in seconds, not at the CI limit.
- `assert_close` compares tensors, or nested dicts/lists of tensors, and says
  which entry differs and by how much.
- `shard` gives each rank its slice of a global batch, so a test can compare
  against single-process training on the concatenated batch.
- `run_subtests` runs a grid of sub-cases inside one body (one spawn for all of
  them) and names the failing case.
- Collective counting lives in `cadence.EventLog` (``log.count("all_reduce")``).

Example::

    def body(seed):
        pg = ...  # cadence.init() already ran; build a Topology if needed
        return loss.item()

    losses = run_distributed(body, 0, world_size=2)
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from cadence.errors import CadenceValueError, SubtestFailure
from cadence.launch import launch

__all__ = [
    "SubtestFailure",
    "assert_close",
    "max_abs_diff",
    "named_grads",
    "named_params",
    "run_distributed",
    "run_subtests",
    "seed_all",
    "shard",
]


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 90.0,
    backend: str = "gloo",
    start: Literal["fresh", "warm"] = "warm",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return per-rank results.

    Each rank has the default process group initialised (collective timeout =
    ``timeout``) and ``torch.set_num_threads(1)``. Any failure or hang stops all
    ranks and raises `cadence.LaunchError` with the remote traceback. Ranks are
    forked from a server that has imported torch once (``start="warm"``, see
    `cadence.launch`): a suite that launches often saves about 2 s a rank. Pass
    ``start="fresh"`` for a new interpreter per rank.
    """
    return launch(
        fn,
        *args,
        nprocs=world_size,
        backend=backend,
        timeout=timeout,
        num_threads=1,
        start=start,
        **kwargs,
    )


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def shard(batch: torch.Tensor, rank: int, world_size: int, dim: int = 0) -> torch.Tensor:
    """This rank's equal slice of ``batch`` along ``dim`` (raises if it does not divide)."""
    n = batch.shape[dim]
    if n % world_size:
        raise CadenceValueError(
            f"batch of {n} along dim {dim} does not split evenly over {world_size} ranks"
        )
    return batch.narrow(dim, rank * (n // world_size), n // world_size)


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for k in obj:
            out.update(_flatten(obj[k], f"{prefix}{k}."))
        return out
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}."))
        return out
    return {prefix.rstrip(".") or "<value>": obj}


def max_abs_diff(actual: Any, expected: Any) -> float:
    """The largest absolute difference over matching tensors of two nested structures."""
    a, e = _flatten(actual), _flatten(expected)
    worst = 0.0
    for key in a:
        x, y = a[key], e[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            diff = (torch.as_tensor(x).double() - torch.as_tensor(y).double()).abs()
            worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        elif isinstance(x, (int, float)) and isinstance(y, (int, float)):
            worst = max(worst, abs(float(x) - float(y)))
    return worst


def assert_close(
    actual: Any,
    expected: Any,
    *,
    atol: float = 1e-6,
    rtol: float = 0.0,
    msg: str = "",
) -> None:
    """Assert two tensors, numbers, or nested dicts/lists of them are equal within tolerance.

    ``None`` must match ``None`` (a gradient that should stay unset). Keys must match.
    """
    a, e = _flatten(actual), _flatten(expected)
    if set(a) != set(e):
        raise AssertionError(
            f"{msg}: keys differ: only in actual {sorted(set(a) - set(e))}, "
            f"only in expected {sorted(set(e) - set(a))}"
        )
    problems = []
    for key in sorted(a):
        x, y = a[key], e[key]
        if x is None or y is None:
            if x is not y:
                problems.append(f"{key}: {_short(x)} vs {_short(y)}")
            continue
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            tx, ty = torch.as_tensor(x), torch.as_tensor(y)
            if tx.shape != ty.shape:
                problems.append(f"{key}: shape {tuple(tx.shape)} vs {tuple(ty.shape)}")
                continue
            tx, ty = tx.detach().double().cpu(), ty.detach().double().cpu()
            diff = (tx - ty).abs()
            bound = atol + rtol * ty.abs()
            if tx.numel() and bool((diff > bound).any()):
                problems.append(f"{key}: max abs diff {float(diff.max()):.3e} > atol {atol:g}")
        elif isinstance(x, (int, float)) and isinstance(y, (int, float)):
            if abs(float(x) - float(y)) > atol + rtol * abs(float(y)):
                problems.append(f"{key}: {x!r} vs {y!r}")
        elif x != y:
            problems.append(f"{key}: {x!r} vs {y!r}")
    if problems:
        head = f"{msg}: " if msg else ""
        raise AssertionError(head + f"{len(problems)} mismatches:\n  " + "\n  ".join(problems[:20]))


def _short(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor{tuple(x.shape)}"
    return repr(x)


def named_grads(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """``{name: grad clone or None}``, for parity comparisons."""
    return {
        n: (p.grad.detach().clone() if p.grad is not None else None)
        for n, p in module.named_parameters()
    }


def named_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def run_subtests(
    grid: Mapping[str, Sequence[Any]],
    fn: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> dict[str, Any]:
    """Run ``fn(*args, **case, **kwargs)`` for every combination in ``grid``.

    One process group (or none) serves every sub-case, which amortises the cost of
    spawning ranks. Cases run in the grid's order (the product of its value lists,
    last key fastest), identically on every rank, so a collective inside ``fn`` stays
    matched. Returns ``{label: result}`` with labels like ``"mode=auto,world=2"``. A
    failing case raises `SubtestFailure` naming the case, chained to the original error.
    """
    keys = list(grid)
    results: dict[str, Any] = {}
    for values in itertools.product(*(grid[k] for k in keys)):
        case = dict(zip(keys, values))
        label = ",".join(
            f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in case.items()
        )
        try:
            results[label] = fn(*args, **case, **kwargs)
        except Exception as e:
            raise SubtestFailure(f"sub-case {label} failed: {type(e).__name__}: {e}") from e
    return results
