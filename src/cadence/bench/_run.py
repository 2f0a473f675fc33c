"""Dispatch one ``cadence bench KIND`` run: measure, print, write record and chart."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, NamedTuple

from cadence.bench._record import write_chart, write_record
from cadence.errors import CadenceValueError

__all__ = ["KINDS", "OPTIONS", "QUESTIONS", "Question", "format_rows", "link_line", "run_bench"]

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


class Question(NamedTuple):
    """A further question one comparison can be asked (``cadence bench pp --bubbles``)."""

    kind: str  # the comparison it belongs to
    module: str  # under cadence.bench: its run() measures it
    options: tuple[str, ...]  # run()'s keyword arguments besides quick and tiny


# [Note: a further question writes a record of its own kind]
# Each question measures something its comparison's defaults do not (another world,
# shape, method or figure), so its record's kind is ``KIND-QUESTION``
# (``pp-bubbles``): `cadence.bench.report` puts only the comparisons' own kinds on the
# page, and a question's record never stands in for them. So does ``precompile`` run
# with any of its `OPTIONS` away from its defaults (``precompile-variant``).
QUESTIONS: dict[str, Question] = {
    "finalize-patterns": Question(
        "dp", "_finalize_patterns", ("world", "layers", "width", "batch", "profile")
    ),
    "memtracker": Question("fsdp", "_memtracker", ("world", "layers", "width", "batch")),
    "bubbles": Question("pp", "_bubbles", ("world", "layers", "width", "batch", "source")),
    "batch-p2p": Question("pp", "_batch_p2p", ("world", "width", "batch")),
    "extended": Question("pickle", "_pickle_extended", ("loads", "dill", "out_of_band")),
}
# Options a comparison itself takes (its record's kind then says so: see above).
OPTIONS: dict[str, tuple[str, ...]] = {
    "step": ("cases",),
    "precompile": ("world", "shared_inductor_cache", "ship_kernels"),
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
    if "what" in record:  # a further question's record says what its ratio divides
        lines.append(f"ratio = {record['what']}")
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
    for title, text in record.get("profiles", {}).items():
        lines += ["", f"--- {title} ---", text.rstrip()]
    return "\n".join(lines)


def run_bench(
    kind: str,
    *,
    out_dir: Path,
    quick: bool = False,
    tiny: bool = False,
    question: str | None = None,
    **options: Any,
) -> tuple[dict[str, Any], Path, Path | None]:
    """Run one comparison, or one of its further `QUESTIONS`; returns (record, JSON path,
    PNG path or None). The record goes into ``out_dir`` and nowhere else."""
    if kind not in KINDS:
        raise CadenceValueError(f"unknown bench {kind!r}; choose one of {', '.join(KINDS)}")
    if question is None:
        name = _MODULES[kind]
    elif question in QUESTIONS and QUESTIONS[question].kind == kind:
        name = QUESTIONS[question].module
    else:
        asks = sorted(q for q, spec in QUESTIONS.items() if spec.kind == kind)
        raise CadenceValueError(
            f"'cadence bench {kind}' has no question {question!r}; "
            f"it has {', '.join(asks) if asks else 'none'}"
        )
    module = importlib.import_module(f"cadence.bench.{name}")
    record = module.run(quick=quick, tiny=tiny, **options)
    record["tiny"] = tiny  # a plumbing check: never shown in the docs
    path = write_record(record, out_dir)
    # A kind whose figure is not a ratio per row (schedules, scale: against a size) draws
    # its own.
    chart = getattr(module, "write_chart", write_chart)(record, path.with_suffix(".png"))
    return record, path, chart
