"""Dispatch one ``cadence bench KIND`` run: measure, print, write record and chart."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from cadence.bench._record import write_chart, write_record
from cadence.errors import CadenceValueError

__all__ = ["KINDS", "format_rows", "link_line", "run_bench"]

KINDS = (
    "dp", "step", "fsdp", "pp", "collectives", "pickle", "precompile", "schedules", "scale"
)  # fmt: skip
_MODULES = {
    "dp": "dp",
    "step": "step",
    "fsdp": "fsdp",
    "pp": "pp",
    "collectives": "collectives",
    "pickle": "pickler",
    "precompile": "precompile",
    "schedules": "schedules",
    "scale": "scale",
}


def _fmt(summary: dict[str, float] | None) -> str:
    if summary is None:
        return "-"
    return f"{summary['median']:.3f} [{summary['q1']:.3f}-{summary['q3']:.3f}]"


def link_line(row: dict[str, Any]) -> str:
    """A step row's link figures: times over compute alone, overlap efficiencies."""
    lk = row["link"]
    c = lk["compute_ms"]
    parts = [f"rate {lk['rate_bps'] / 1e9:.3g} Gbit/s" if lk["rate_bps"] else "unshaped"]
    for v in ("cadence", "torch", "torch_best"):
        if v in lk:
            f = lk[v]
            eff = "-" if f["efficiency"] is None else f"{f['efficiency']:.2f}"
            parts.append(
                f"{v}: {lk['bytes'][v] / 2**20:.1f} MiB, wire {f['wire_ms'] / c:.2f}C, "
                f"bound {f['pattern_bound_ms'] / c:.2f}C (CPU {f['cpu_bound_ms'] / c:.2f}C), "
                f"step {f['measured_ms'] / c:.2f}C, eff {eff}"
            )
    return "; ".join(parts)


def format_rows(record: dict[str, Any]) -> str:
    """The record as a plain-text table (what the command prints)."""
    m = record["machine"]
    lines = [
        f"cadence bench {record['kind']}{' --quick' if record['quick'] else ''}: "
        f"{m['cpu_count']} CPUs, load average {m['loadavg_before'][0]:.2f} before / "
        f"{m['loadavg'][0]:.2f} after; settings {record['settings']}",
        "ratio = cadence / reference, aa = reference / a second reference; "
        "median [quartiles] over paired repetitions",
    ]
    width = max(len(f"{r['case']} {r['metric']}") for r in record["rows"])
    for r in record["rows"]:
        target = "" if r.get("target") is None else f"  target <= {r['target']:.2f}"
        extra = "  ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
            for k, v in r.get("extra", {}).items()
        )
        for key, unit in (("abs_ms", "ms"), ("abs_mib", "MiB")):
            if key in r:
                extra += "  " + " ".join(f"{k}={v:.1f}{unit}" for k, v in r[key].items())
        lines.append(
            f"{(r['case'] + ' ' + r['metric']).ljust(width)}  ratio {_fmt(r['ratio'])}  "
            f"aa {_fmt(r.get('aa'))}{target}  {extra}"
        )
        if "ratio_best" in r:
            lines.append(f"{''.ljust(width)}  vs torch's best {_fmt(r['ratio_best'])}")
        if "link" in r:
            lines.append(f"{''.ljust(width)}  {link_line(r)}")
    if m["cpu_count"] and max(m["loadavg"][0], m["loadavg_before"][0]) > m["cpu_count"]:
        lines.append("WARNING: load average above the core count: the figures are noisy")
    return "\n".join(lines)


def run_bench(
    kind: str,
    *,
    out_dir: Path,
    quick: bool = False,
    tiny: bool = False,
    **options: Any,
) -> tuple[dict[str, Any], Path, Path | None]:
    """Run one comparison; returns (record, JSON path, PNG path or None)."""
    if kind not in KINDS:
        raise CadenceValueError(f"unknown bench {kind!r}; choose one of {', '.join(KINDS)}")
    module = importlib.import_module(f"cadence.bench.{_MODULES[kind]}")
    record = module.run(quick=quick, tiny=tiny, **options)
    record["tiny"] = tiny  # a plumbing check: never shown in the docs
    path = write_record(record, out_dir)
    # A kind whose figure is not a ratio per row (schedules, scale: against a size) draws
    # its own.
    chart = getattr(module, "write_chart", write_chart)(record, path.with_suffix(".png"))
    return record, path, chart
