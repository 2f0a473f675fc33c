"""Peak memory growth of a few steps, in a process of its own.

[Note: measuring peak memory growth]
Memory is what the process really holds, not a tensor-level estimate: buffers
kept alive by asynchronous collectives, the allocator's slack and the
communication library's staging all count. Each implementation runs in its own
fresh process tree (peaks of two implementations in one process would mask each
other). Per measurement the kernel's high-water mark is reset
(``/proc/self/clear_refs`` with ``5``), the baseline is the current RSS after the
model is built and wrapped, and the growth is ``VmHWM - baseline`` over a few
steps; on CUDA it is the growth of ``torch.cuda.max_memory_allocated`` instead.
`MEMORY_ENV` pins glibc's mmap threshold to 64 KiB in these processes so a freed
tensor's pages leave the process at once and one measurement's free memory does
not hide the next one's peak.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cadence.bench._errors import MemoryProbeError
from cadence.bench._record import paired_ratios, ratio_summary

__all__ = ["MEMORY_ENV", "MemoryProbeError", "floor_page", "memory_row", "peak_growth"]

MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise MemoryProbeError(f"{field} not in /proc/self/status")


def peak_growth(step: Callable[[], None], steps: int, device: str) -> int:
    """Bytes the peak grew by over ``steps`` calls of ``step``, from now."""
    import torch

    if device != "cpu":  # on a GPU the device allocator's peak is the figure
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        raise MemoryProbeError(
            f"cannot reset the RSS high-water mark (/proc/self/clear_refs: {exc}); "
            "the memory comparison needs Linux"
        ) from exc
    before = _status_kib("VmRSS")
    for _ in range(steps):
        step()
    return 1024 * (_status_kib("VmHWM") - before)


def floor_page(nbytes: int) -> int:
    """At least one page: a tiny model may not grow at all, and ratios need a divisor."""
    return max(nbytes, 4096)


def memory_row(
    case: str, per: dict[str, list[int]], mine: str, *, gpu: bool, target: float | None
) -> dict[str, Any]:
    """One peak-memory row: ``per[variant]`` holds a figure per rank; ``mine`` is
    compared with ``torch``, and ``torch`` with ``torch_b`` for the A/A."""
    return {
        "case": case,
        "metric": "peak CUDA memory growth" if gpu else "peak RSS growth",
        "ratio": ratio_summary(paired_ratios(per[mine], per["torch"])),
        "aa": ratio_summary(paired_ratios(per["torch"], per["torch_b"])),
        "target": target,
        "abs_mib": {k: max(v) / 2**20 for k, v in per.items()},
    }
