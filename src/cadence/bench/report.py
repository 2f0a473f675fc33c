"""Generate ``docs/benchmarks.md`` from the newest bench records.

``cadence bench report`` reads the results folder's ``*.json`` (``--results``) and the records
the page already cites (``docs/records/``), takes the newest full (non ``--quick``)
record of each kind on the primary torch (`PRIMARY_TORCH`), or the newest quick one
when no full one exists, and writes one table per kind with the ratio, its spread, the
A/A noise, the target and the machine load of that run. Full records on other torch
releases are listed after them as history. The records the page cites are copied to
``docs/records/`` (see [Note: only cited records are kept]). Everything below
`HAND_WRITTEN` in the page (profiles, the further questions) is kept as it is.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cadence.bench._run import KINDS

# Kinds a record may have besides the runnable ones: ``step --link calibrated``
# writes ``step-link`` (see `cadence.bench._calibrate`).
LINK_KIND = "step-link"
REPORT_KINDS = (*KINDS[:2], LINK_KIND, *KINDS[2:])

__all__ = [
    "HAND_WRITTEN",
    "PRIMARY_TORCH",
    "history",
    "latest_records",
    "render",
    "torch_release",
    "write_docs",
]

_TITLES = {
    "dp": "DataParallel vs torch DDP",
    "step": "Whole training steps: caller-owned timing vs torch",
    LINK_KIND: "Whole steps on an emulated cluster link: overlap against its bound",
    "fsdp": "fully_shard vs torch FSDP2",
    "pp": "pipeline runtime vs torch pipelining",
    "collectives": "cadence's exchange collectives vs gloo's own",
    "pickle": "cadence.pickling vs cloudpickle",
    "precompile": "precompile vs torch.compile on every rank: time to the first step",
    "schedules": "Schedules at scale",
    "scale": "Scale: schedules, setup bytes and wrapper init against size",
}

# What a kind's fitted slopes are of, printed above their list.
_SLOPES = {
    "schedules": "Fitted slopes of log(time) over log(actions):",
    "scale": "Fitted slopes of log(y) over log(x), per panel of the chart:",
}

# What a kind's ratio does and does not mean, printed above its table.
_NOTES = {
    LINK_KIND: (
        "The step cases again, each with its ranks on an emulated link of its own\n"
        "([link.md](link.md)): at the rate where the wire time of the bytes of the side\n"
        "that moves more equals the case's backward compute (calibrated), and 4x\n"
        "slower. Every byte any rank sends is counted on the link's one queue. Per\n"
        "side: MiB on the wire per step; wire time, the bound perfect overlap allows\n"
        "for the case's pattern and the CPU bound (all ranks' CPU seconds over the\n"
        "cores, or the compute before the last backward and the CPU after its start\n"
        "over the cores, the larger), and the step, as multiples of compute alone (C);\n"
        "overlap efficiency = (serial - step) / (serial - bound), with serial = C + wire\n"
        "and bound the larger of the two bounds; room = serial - bound, what overlap\n"
        "could hide at best (cadence's); efficiency is not defined where the room is\n"
        "under C/10\n"
        '("CPU-bound" where the CPU bound is the larger bound). Targets: at the\n'
        "calibrated rate efficiency >= 0.90 and a ratio per case, at both rates\n"
        "never slower than torch (`LINK_TARGETS`). The efficiency target is read\n"
        "against the pattern bound alone, and is impossible where the cores cannot reach\n"
        "it there ([Note: an efficiency target the cores rule out] in\n"
        "`cadence/bench/report.py`). torch's best is its strongest configuration of the\n"
        "pattern where it is not the plain loop: DDP's fused optimizer\n"
        "(`_register_fused_optim`) for dense AdamW, DDP's own manual finalization for\n"
        "the recommender. Each bound is derived in [Note: the bound perfect overlap\n"
        "allows] (`cadence/bench/_bound.py`) and read in the hand-written part below.\n"
    ),
    "step": (
        "Whole steps (zero_grad, forward, backward, optimizer step), stepped interleaved in\n"
        "the same ranks: ratio = cadence with its overlap / torch stepping after backward,\n"
        "A/A = torch / torch. `dense_adamw`: DataParallel with `overlap_optimizer` (each\n"
        "bucket stepped while later buckets reduce) vs DDP + `opt.step()`; `fsdp_adamw`:\n"
        "fully_shard with `overlap_optimizer` (per unit) vs FSDP2 + `opt.step()`. `recommender`:\n"
        "the sparse embedding's exchange and step run while the dense buckets are in\n"
        "flight (manual finalization) vs after DDP's backward. `nanogpt_dp` and\n"
        "`nanogpt_fsdp`: nanoGPT's loop (a GPT-2-shaped TinyGPT scaled down to a CPU, AdamW\n"
        "with nanoGPT's decay groups, 4 microbatches synchronized on the last) with\n"
        "`overlap_optimizer`, vs DDP (`require_backward_grad_sync`) and FSDP2\n"
        "(`set_requires_gradient_sync`) + `opt.step()`. `pipeline`: the GPT in 2 stages,\n"
        "1F1B, pp 2 x dp 2 at world 4: cadence's runtime over DataParallel stages, each\n"
        "stepped as its deferred reduction completes, vs torch pipelining over DDP stages +\n"
        "`opt.step()` after the schedule. `limit_*` is each variant's step time over the\n"
        "same step with no communication at all (the pipeline's: with no data-parallel\n"
        "reduction; 1.00 = fully hidden); `cadence_sync` is cadence's wrapper stepped as\n"
        "torch steps.\n"
    ),
    "schedules": (
        "Building (generate + lower) and proving (`verify`: validation + strict\n"
        "simulation) every generator's schedule at p ranks and m = 4p microbatches, in\n"
        "one process, one repetition per size; ratio = cadence's build / torch's\n"
        "construction + lowering of the same schedule with fake stages (what\n"
        "`get_schedule_ops(..., with_comms=True)` runs), where torch has one. torch\n"
        "proves nothing, so the proof is listed beside it (`proof/build`). Absolute\n"
        "times come from a noisy 2-core machine shared with other jobs: read the ratios\n"
        "and the fitted log-log slopes (1.0 = linear in actions), listed below the\n"
        "table. See [pipeline.md](pipeline.md) on what a rank computes at start-up.\n"
    ),
    "scale": (
        "Four quantities against the size that should drive them, log-log, with the\n"
        "fitted slope of each line below the table (0 = flat, -1 = 1/world, 1 = linear):\n"
        "schedule build and proof time against p·m (a few generators, measured as in\n"
        "`cadence bench schedules`, torch's build beside cadence's); setup bytes of the\n"
        "busiest rank against world size on real gloo ranks (pipeline build, fully_shard\n"
        "and DataParallel construction; torch has no equivalent log); fully_shard against\n"
        "FSDP2 and DataParallel against DDP as rank 0 of torch's fake process group at\n"
        "64 to 8192 ranks: init time (ratio = cadence / torch, A/A = torch / torch) and\n"
        "parameter bytes per rank. DDP's backward cannot run on the fake group, so only\n"
        "construction is compared.\n"
    ),
    "collectives": (
        "One collective per step through `cadence.Comm`: ratio = exchange / gloo's own,\n"
        "A/A = gloo's own / gloo's own again. Sizes are the full tensor. The default\n"
        '(`CollectiveAlgorithms()`, `"auto"`) is read from this table: per collective and\n'
        "world, the exchange from the smallest size whose median ratio, and every larger\n"
        "size's, is under 0.95; gloo's own above the largest measured world. All-reduce\n"
        "stays gloo's own (opt-in exchange). NCCL is never replaced. See\n"
        "[Where the time goes](#where-the-time-goes-profiles).\n"
    ),
    "precompile": (
        "Fresh rank processes with an empty inductor cache each (cold nodes), per\n"
        "repetition: `jit` (every rank compiles its step with `torch.compile`),\n"
        "`precompile` (rank 0 compiles ahead of time and broadcasts, the others load)\n"
        "and `cache` (every rank loads the artifact a previous job wrote to\n"
        "`cache_dir`); ratio = mode / `jit`, A/A = `jit` / a second `jit`. Time is the\n"
        "slowest rank's, from a barrier to the end of the first backward; CPU time is\n"
        "summed over ranks, the C++ compiler's processes included. On CPU the gain is\n"
        "one compile per job instead of one per rank, not a faster kernel: every mode\n"
        "runs the same kernels. Rank 0 still compiles as long as a `jit` rank does, so\n"
        "`precompile` shortens the wall time only where the ranks' compiles would\n"
        "compete for the same cores; without that contention it adds the broadcast and\n"
        "the load to one compile. The `cache` row is what a restarted job gains.\n"
    ),
}

_HEADER = """\
# Benchmarks

<!-- Generated by `cadence bench report` from the records in --results and the ones it
     cites (records/), down to the hand-written part at the end. Do not edit the
     generated part: rerun the benchmarks and the report instead. -->

Every comparison runs cadence and PyTorch's own implementation (cloudpickle for the
pickler, `torch.compile` on every rank for precompile) in the same process tree
(precompile: in fresh rank processes per run, see its section), interleaved
repetition by repetition with the order rotated, so machine noise hits both alike.
**ratio** is cadence / torch per repetition (lower is better): median, with the
quartiles and the range over repetitions. **A/A** is torch against a second identical
torch copy under the same noise: a ratio within the A/A spread of 1.00 is no measured
difference. The load average (1 minute) before and after the run and the core count
are given per kind; it counts the benchmark's own rank processes (two busy ranks on
two cores read as about 2, world 4 as about 4), and a run that starts right after
another inherits that one's figure. Absolute times are listed in each record and mean
little on a shared CPU machine (on CUDA, with NCCL, they are the figure to read).
Correctness is the test suite's job, never the benchmark's.

Reproduce (from the repository root):

```
cadence bench dp          # DataParallel vs DDP, three shapes
cadence bench step        # whole steps: overlap_optimizer (dense, nanoGPT, pipeline), sparse
cadence bench step --link calibrated  # the same on an emulated link, against the bound
cadence bench step --link calibrated --launches 3  # each case in 3 launches, their median
cadence bench fsdp        # fully_shard vs FSDP2, prefetch x reshard_after_forward, RSS
cadence bench pp          # five schedules, world 2 and 4
cadence bench collectives # exchange vs gloo's reduce-scatter, all-gather, all-reduce
cadence bench pickle      # pickler vs cloudpickle
cadence bench precompile  # time to the first step on 2 ranks: jit, precompile, cache
cadence bench schedules   # build and proof of every generator, p = 8..128, vs torch
cadence bench scale       # log-log slopes: schedules, setup bytes, init and memory vs world
cadence bench report      # regenerate this page
```

`--quick` runs fewer repetitions (a minute or two per kind on 2 cores). `--link
RATE` runs any kind with its ranks on an emulated link ([link.md](link.md)).
Where the time goes, by profile (op and call counts, fractions of a step), and the
further questions (`cadence bench dp --finalize-patterns`, ...) that go deeper than
these tables: the hand-written
[last part of this page](#where-the-time-goes-profiles).
"""


# The torch release users install today, the primary lane of constraints.txt: its records
# are the ones the page shows (a test keeps the two equal). Records on other releases
# are kept (in docs/records) as history and listed at the end of the page.
PRIMARY_TORCH = "2.15"


def torch_release(record: dict[str, Any]) -> str:
    """``major.minor`` of the torch a record ran on (``"2.13.0+cpu"`` -> ``"2.13"``)."""
    version = str(record.get("machine", {}).get("torch") or "")
    return ".".join(version.split("+")[0].split(".")[:2])


def _records(*folders: Path) -> list[dict[str, Any]]:
    """Every real record in ``folders``; a file name seen twice is one record (the page's
    records/ holds copies of results/ files)."""
    paths: dict[str, Path] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.json")):
            paths.setdefault(path.name, path)
    out = []
    for path in sorted(paths.values(), key=lambda p: p.name):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if record.get("tiny") or record.get("kind") not in REPORT_KINDS:
            continue
        record["_path"] = str(path)  # not written back: locates the chart
        out.append(record)
    return out


def record_key(record: dict[str, Any]) -> str:
    """A record's place on the page: its kind, or ``kind@LINK`` for a run on an
    emulated link (``--link RATE``), which never stands in for the unshaped run."""
    link = record.get("settings", {}).get("link")
    if link and record["kind"] != LINK_KIND:
        return f"{record['kind']}@{link}"
    return str(record["kind"])


def latest_records(*folders: Path) -> dict[str, dict[str, Any]]:
    """`record_key` -> the newest full record on the primary torch (else the newest
    quick one; a key with no record on the primary torch falls back to its newest on
    any)."""
    best: dict[str, tuple[tuple[bool, bool, str], dict[str, Any]]] = {}
    for record in _records(*folders):
        key = (torch_release(record) == PRIMARY_TORCH, not record["quick"], record["created"])
        place = record_key(record)
        if place not in best or key > best[place][0]:
            best[place] = (key, record)
    return {k: v for k, (_, v) in best.items()}


def history(*folders: Path) -> list[dict[str, Any]]:
    """Full records on another torch than the primary, oldest first: earlier peers."""
    return sorted(
        (r for r in _records(*folders) if torch_release(r) != PRIMARY_TORCH and not r["quick"]),
        key=lambda r: (r["kind"], r["created"]),
    )


def _cell(s: dict[str, float] | None) -> str:
    if s is None:
        return "-"
    return f"{s['median']:.2f} ({s['q1']:.2f}-{s['q3']:.2f}; {s['min']:.2f}-{s['max']:.2f})"


def _verdict(row: dict[str, Any]) -> str:
    if row.get("target") is None:
        return "-"
    met = row["ratio"]["median"] <= row["target"]
    return f"<= {row['target']:.2f}: {'met' if met else '**missed**'}"


def _extra(row: dict[str, Any]) -> str:
    parts = []
    for k, v in row.get("extra", {}).items():
        if isinstance(v, dict):  # a group of figures, e.g. a pipeline's bound on a link
            v = ", ".join(f"{kk} {vv:.2f}" if isinstance(vv, float) else f"{kk} {vv}"
                          for kk, vv in v.items())  # fmt: skip
        parts.append(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}")
    for key, unit in (("abs_ms", "ms"), ("abs_mib", "MiB")):
        if key in row:  # medians: the figure to read on a dedicated GPU machine
            parts.append(", ".join(f"{k} {v:.1f} {unit}" for k, v in row[key].items()))
    return "; ".join(parts) or "-"


def render(
    records: dict[str, dict[str, Any]],
    page_dir: Path | None = None,
    older: list[dict[str, Any]] | None = None,
) -> str:
    """The page; ``page_dir`` (where it is written) makes chart links relative to it;
    ``older`` (see `history`) adds the earlier records' section."""
    out = [_HEADER]
    for kind in REPORT_KINDS:
        out.append(f"\n## {_TITLES[kind]}\n")
        if kind in _NOTES:
            out.append(_NOTES[kind])
        record = records.get(kind)
        if record is None:
            command = "step --link calibrated" if kind == LINK_KIND else kind
            out.append(f"No record yet: run `cadence bench {command}`.\n")
            continue
        if kind == LINK_KIND:
            out.append(_link_tables(record, page_dir))
            continue
        out.append(_kind_table(kind, record, page_dir))
        for place in sorted(k for k in records if k.startswith(f"{kind}@")):
            linked = records[place]
            out.append(f"\n### {_TITLES[kind]}, on an emulated link of {_link_label(linked)}\n")
            out.append(_kind_table(kind, linked, page_dir, link=_link_flag(linked)))
    if older:
        out.append(_history_section(older, page_dir))
    return "\n".join(out)


def _link_label(record: dict[str, Any]) -> str:
    """The link a record ran on, as asked and as its self-check measured it."""
    st = record["settings"]
    asked, got = st.get("link_rate_asked_bps"), st.get("link_rate_measured_bps")
    label = f"{asked / 1e6:g} Mbit/s" if asked else str(st["link"])
    if st.get("link_delay_ms"):
        label += f", {st['link_delay_ms']:g} ms delay"
    if got:
        label += f" (measured {got / 1e6:.0f} Mbit/s"
        label += f", round trip {st['link_rtt_ms']:.2f} ms)" if st.get("link_rtt_ms") else ")"
    return label


def _link_flag(record: dict[str, Any]) -> str:
    """The ``--link`` value that reproduces a record's link."""
    st = record["settings"]
    asked = st.get("link_rate_asked_bps")
    flag = f"{asked / 1e6:g}mbit" if asked else str(st["link"])
    return flag + (f",delay={st['link_delay_ms']:g}" if asked and st.get("link_delay_ms") else "")


def _kind_table(
    kind: str, record: dict[str, Any], page_dir: Path | None, link: str | None = None
) -> str:
    """One record's table, with its settings line and its chart."""
    out: list[str] = []
    m = record["machine"]
    flags = (" --quick" if record["quick"] else "") + (f" --link {link}" if link else "")
    out.append(
        f"`cadence bench {kind}{flags}`, {record['created']}: "
        f"{m['cpu_count']} CPUs{', ' + m['cuda'] if m.get('cuda') else ''}, torch "
        f"{m.get('torch')}, load average {m['loadavg_before'][0]:.2f} before / "
        f"{m['loadavg'][0]:.2f} after. Settings: "
        + ", ".join(f"{k} {v}" for k, v in record["settings"].items())
        + ".\n"
    )
    out.append("| case | measure | ratio median (quartiles; range) | A/A | target | other |")
    out.append("| --- | --- | --- | --- | --- | --- |")
    for row in record["rows"]:
        case = f"{row['case']}" + (f" ({row['what']})" if row.get("what") else "")
        out.append(
            f"| {case} | {row['metric']} | {_cell(row['ratio'])} | {_cell(row.get('aa'))} "
            f"| {_verdict(row)} | {_extra(row)} |"
        )
    if record.get("slopes"):
        out.append(f"\n{_SLOPES.get(kind, 'Fitted log-log slopes:')}\n")
        for name, fits in record["slopes"].items():
            out.append(
                f"- {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in fits.items() if v is not None)
            )
    chart = Path(record.get("_path", "")).with_suffix(".png")
    if page_dir is not None and chart.name and chart.exists():
        rel = os.path.relpath(chart.resolve(), page_dir.resolve())
        out.append(f"\n![cadence bench {kind}]({rel})")
        out.extend(_pp_timelines(kind, record, chart, page_dir))
    out.append("")
    return "\n".join(out)


def _pp_timelines(kind: str, record: dict[str, Any], chart: Path, page_dir: Path) -> list[str]:
    """``bench pp`` on a link: each traced case's picture, beside the record's chart."""
    if kind != "pp":
        return []
    from cadence.bench.pp import timeline_path

    out = []
    for row in record["rows"]:
        pic = timeline_path(chart, row["case"])
        if "trace" in row and pic.exists():
            rel = os.path.relpath(pic.resolve(), page_dir.resolve())
            out.append(f"![{row['case']}, one traced step per side]({rel})")
    return out


def _c(row: dict[str, Any], variant: str, key: str) -> str:
    lk = row["link"]
    if variant not in lk:
        return "-"
    return f"{lk[variant][key] / lk['compute_ms']:.2f}"


def _room(row: dict[str, Any]) -> str:
    f, c = row["link"]["cadence"], row["link"]["compute_ms"]
    return f"{(f['serial_ms'] - f['bound_ms']) / c:.2f}"


def _launch_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Each launch of a row run in several, as the row the efficiency functions read
    (its own link figures, which `_by_todays_bound` recomputed with the row's); [] for
    a row of one launch."""
    runs = row.get("launches") or []
    if len(runs) < 2 or not all(isinstance(r.get("link"), dict) for r in runs):
        return []
    return [{"link": r["link"]} for r in runs]


def _over_launches(
    row: dict[str, Any], of_one: Callable[[dict[str, Any]], float | None]
) -> float | None:
    """A figure that is a ratio of differences, for a row of several launches: the
    median of each launch's own (see [Note: launches, not only repetitions] in
    `cadence/bench/_launches.py`). Where one launch has none (less than C/10 to hide
    there), or the row has one launch, the figure from the row's own medians."""
    values = [of_one(r) for r in _launch_rows(row)]
    if values and all(v is not None for v in values):
        return float(statistics.median(v for v in values if v is not None))
    return of_one(row)


def _efficiency(row: dict[str, Any], variant: str, bound: str = "bound_ms") -> float | None:
    """Recomputed from the record's times, so every record reads by today's rule;
    against ``bound`` (the larger bound, or ``pattern_bound_ms`` alone); for a row of
    several launches, the median of the launches' own."""
    return _over_launches(row, lambda r: _efficiency_of(r, variant, bound))


def _efficiency_of(row: dict[str, Any], variant: str, bound: str) -> float | None:
    from cadence.bench._bound import efficiency

    f = row["link"][variant]
    return efficiency(serial=f["serial_ms"], bound=f[bound], measured=f["measured_ms"],
                      compute=row["link"]["compute_ms"])  # fmt: skip


def _no_efficiency(row: dict[str, Any], variant: str) -> str:
    """Why a variant's efficiency is not defined."""
    f = row["link"][variant]
    return "CPU-bound" if f["cpu_bound_ms"] >= f["pattern_bound_ms"] else "nothing to hide"


def _eff(row: dict[str, Any], variant: str) -> str:
    if variant not in row["link"]:
        return "-"
    e = _efficiency(row, variant)
    return _no_efficiency(row, variant) if e is None else f"{e:.2f}"


# The link's targets: overlap efficiency >= 0.90 at the calibrated rate, and per case a
# ratio against torch's plain loop ("torch") or its strongest configuration
# ("torch_best"); at either rate, never slower than torch (checked beside a case's own
# ratio at the calibrated rate: a stricter one the bound rules out leaves it standing).
LINK_EFFICIENCY_TARGET = 0.90
NEVER_SLOWER = ("torch", 1.00)
LINK_TARGETS: dict[str, tuple[tuple[str, float], ...]] = {
    "dense_adamw": (("torch", 0.92),),
    "fsdp_adamw": (("torch", 0.85),),
    "recommender": (("torch_best", 0.90), ("torch", 0.80)),
    "nanogpt_dp": (("torch", 1.00),),
    "nanogpt_fsdp": (("torch", 1.00),),
    "pipeline": (("torch", 0.80),),
}


# [Note: an efficiency target the cores rule out]
# The efficiency target is defined against the bound of the case's dependencies, the
# pattern bound. The table's efficiency column uses the larger of that and the CPU
# bound, which says how much of the room the cores leave a step actually hid. The
# target is read by that definition: met where the efficiency against the
# pattern bound reaches it. No step is shorter than its CPU seconds over the cores,
# so against the pattern bound no variant can reach more than (serial - cpu) /
# (serial - pattern), the cores' limit; cpu is the least any variant of the row
# needed (a variant that moves fewer bytes needs less, so the limit errs high).
# Where the cores' limit is under the target, the target is impossible on this
# machine; the verdict gives that limit beside cadence's efficiency against the
# pattern bound, and the table's column what cadence hid of the room the cores leave.

VARIANTS_WITH_BOUNDS = ("cadence", "cadence_sync", "torch", "torch_best")


def _cores_limit(row: dict[str, Any]) -> float | None:
    """The best efficiency against the pattern bound that the cores allow (see
    [Note: an efficiency target the cores rule out]); None where the pattern leaves
    less than C/10 to hide; over launches, the median of the launches' own."""
    return _over_launches(row, _cores_limit_of)


def _cores_limit_of(row: dict[str, Any]) -> float | None:
    from cadence.bench._bound import MIN_HIDEABLE

    lk = row["link"]
    f = lk["cadence"]
    room = f["serial_ms"] - f["pattern_bound_ms"]
    if room < MIN_HIDEABLE * lk["compute_ms"]:
        return None
    cpu = min(lk[v]["cpu_bound_ms"] for v in VARIANTS_WITH_BOUNDS if v in lk)
    return float((f["serial_ms"] - cpu) / room)


def _efficiency_verdict(row: dict[str, Any]) -> str:
    """The calibrated rate's efficiency target, by [Note: an efficiency target the cores
    rule out]."""
    on_pattern = _efficiency(row, "cadence", "pattern_bound_ms")
    if on_pattern is None or _efficiency(row, "cadence") is None:
        return f"impossible ({_no_efficiency(row, 'cadence')})"
    if on_pattern >= LINK_EFFICIENCY_TARGET:
        return "met"
    limit = _cores_limit(row)
    if limit is not None and limit < LINK_EFFICIENCY_TARGET:
        return (
            f"impossible on these cores (against the pattern's bound they allow "
            f"{max(limit, 0.0):.2f}; cadence {on_pattern:.2f})"
        )
    return f"**missed** ({on_pattern:.2f} against the pattern's bound)"


def _ratio_verdict(row: dict[str, Any], against: str, target: float) -> str | None:
    """One ratio target's verdict; None where the row has no such reference."""
    ratio = row.get("ratio_best") if against == "torch_best" else row["ratio"]
    if ratio is None or against not in row["link"]:
        return None
    name = "torch's best" if against == "torch_best" else "torch"
    # The best ratio physics allows: cadence at its bound over the reference as measured.
    allowed = row["link"]["cadence"]["bound_ms"] / row["link"][against]["measured_ms"]
    if ratio["median"] <= target:
        verdict = "met"
    elif allowed > target:
        verdict = f"impossible (the bound allows {allowed:.2f})"
    else:
        verdict = f"**missed** (the bound allows {allowed:.2f})"
    return f"<= {target:.2f} of {name}: {verdict}"


def _link_verdict(row: dict[str, Any]) -> str:
    calibrated = row["rate"] == "calibrated"
    targets = LINK_TARGETS.get(row["case"], ()) if calibrated else ()
    if NEVER_SLOWER not in targets:
        targets = (*targets, NEVER_SLOWER)
    out = [v for against, target in targets if (v := _ratio_verdict(row, against, target))]
    if calibrated:
        out.append(f"eff >= {LINK_EFFICIENCY_TARGET:.2f}: {_efficiency_verdict(row)}")
    return "; ".join(out)


def _by_todays_bound(row: dict[str, Any]) -> dict[str, Any]:
    """The row with every variant's pattern bound (and so its bound) recomputed by
    today's rule from the inputs the record keeps (`_bound.recomputed`), in the row's
    link figures and in each of its launches'."""
    from cadence.bench._bound import recomputed
    from cadence.bench.step import CASES

    row = copy.deepcopy(row)
    kind = CASES[row["case"]]["kind"]
    launches = row.get("launches") or []
    links = [row["link"], *(r["link"] for r in launches if isinstance(r.get("link"), dict))]
    for lk in links:
        for v in VARIANTS_WITH_BOUNDS:
            if v in lk:
                pattern = recomputed(kind, lk, v)
                lk[v]["pattern_bound_ms"] = pattern
                lk[v]["bound_ms"] = max(pattern, lk[v]["cpu_bound_ms"])
    return row


def _link_tables(record: dict[str, Any], page_dir: Path | None = None) -> str:
    """One table per rate of a ``step-link`` record (see `cadence.bench._calibrate`)."""
    record = {**record, "rows": [_by_todays_bound(r) for r in record["rows"]]}
    m = record["machine"]
    launches = int(record["settings"].get("launches", 1))
    flags = (" --quick" if record["quick"] else "") + (
        f" --launches {launches}" if launches > 1 else ""
    )
    lines = [
        f"`cadence bench step --link calibrated{flags}`, "
        f"{record['created']}: {m['cpu_count']} CPUs, torch {m.get('torch')}. Settings: "
        + ", ".join(f"{k} {v}" for k, v in record["settings"].items())
        + ". Times are multiples of the case's compute alone (C); each case ran on a "
        "link of its own, its load average (1 min, before / after) in the last column.\n"
    ]
    if launches > 1:
        lines.append(
            f"Every case ran in {launches} launches, each on a fresh link with fresh ranks: "
            "each figure below is the median over launches of that launch's own (quartiles "
            "and range included); an efficiency, and the cores' limit on it, is computed in "
            "each launch from its own times and the median taken; the verdicts read those "
            "medians; each launch's own figures follow each table ([Note: launches, not "
            "only repetitions] in `cadence/bench/_launches.py`).\n"
        )
    rates = list(dict.fromkeys(row["rate"] for row in record["rows"]))
    for rate in rates:
        lines.append(f"\n**{rate}**\n")
        lines.append(
            "| case | link asked (measured) | MiB/step cadence, torch | wire | bound: pattern; "
            "CPU (cadence) | room | step: cadence, torch, torch's best | efficiency: cadence, "
            "torch, torch's best | cadence / torch | cadence / torch's best | A/A | targets "
            "| load |"
        )
        lines.append("| --- " * 13 + "|")
        for row in (r for r in record["rows"] if r["rate"] == rate):
            lk, ls = row["link"], row["link_settings"]
            asked = ls["link_rate_asked_bps"] / 1e9
            got = (ls["link_rate_measured_bps"] or 0) / 1e9
            mib = ", ".join(
                f"{lk['bytes'][v] / 2**20:.1f}" for v in ("cadence", "torch") if v in lk["bytes"]
            )
            best = row.get("ratio_best")
            lines.append(
                f"| {row['case']} | {asked:.3g} Gbit/s ({got:.3g}) | {mib} "
                f"| {_c(row, 'cadence', 'wire_ms')} "
                f"| {_c(row, 'cadence', 'pattern_bound_ms')}; {_c(row, 'cadence', 'cpu_bound_ms')} "
                f"| {_room(row)} "
                f"| {_c(row, 'cadence', 'measured_ms')}, {_c(row, 'torch', 'measured_ms')}, "
                f"{_c(row, 'torch_best', 'measured_ms')} "
                f"| {_eff(row, 'cadence')}, {_eff(row, 'torch')}, {_eff(row, 'torch_best')} "
                f"| {_cell(row['ratio'])} | {_cell(best)} | {_cell(row.get('aa'))} "
                f"| {_link_verdict(row)} | {row['load'][0]:.2f} / {row['load'][1]:.2f} |"
            )
        if launches > 1:
            lines.append(
                "\nPer launch (cadence / torch, / torch's best, A/A; efficiency against the "
                "pattern's bound: cadence, torch; C; load before / after; * the traced "
                "launch):\n"
            )
            lines.append(
                "| case | launch | cadence / torch | / torch's best | A/A | efficiency: "
                "cadence, torch | C (ms) | load |"
            )
            lines.append("| --- " * 8 + "|")
            for row in (r for r in record["rows"] if r["rate"] == rate):
                lines.extend(_launch_table(row))
    pictures = [(r["case"], r["rate"], r["timeline"]) for r in record["rows"] if r.get("timeline")]
    if pictures and page_dir is not None:
        lines.append(
            "\nOne traced step per variant, per case and rate (rank 0's clock). Under each "
            "variant's phases, where a record has it, a grey strip shows the link's wire "
            "through that step: the darker, the more of the rate every rank's bytes used in "
            "each 2 ms.\n"
        )
        folder = Path(record.get("_path", "")).parent
        for case, rate, name in pictures:
            rel = os.path.relpath((folder / name).resolve(), page_dir.resolve())
            lines.append(f"![{case}, {rate}]({rel})")
    return "\n".join(lines) + "\n"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _launch_table(row: dict[str, Any]) -> list[str]:
    """Each launch's own figures, under a rate's table of medians."""
    lines = []
    for i, (run, one) in enumerate(zip(row.get("launches") or [], _launch_rows(row))):
        load = run.get("load") or [None, None]
        mark = "*" if i == row.get("traced_launch") else ""
        lines.append(
            f"| {row['case']} | {i + 1}{mark} | {_num(run['ratio'])} "
            f"| {_num(run.get('ratio_best'))} | {_num(run.get('aa'))} "
            f"| {_num(_efficiency_of(one, 'cadence', 'pattern_bound_ms'))}, "
            f"{_num(_efficiency_of(one, 'torch', 'pattern_bound_ms'))} "
            f"| {_ms(one['link'].get('compute_ms'))} | {_num(load[0])} / {_num(load[1])} |"
        )
    return lines


def _history_section(older: list[dict[str, Any]], page_dir: Path | None) -> str:
    """One line per earlier record: its torch, when, and its rows that have a target."""
    lines = [
        f"\n## Earlier records (torch other than {PRIMARY_TORCH})\n",
        "The same comparisons against earlier torch releases' DDP, FSDP2 and pipelining,",
        "kept as history: the ratios above are the ones that count. Median ratio of each",
        "row that has a target (the records hold every row).\n",
        "| kind | run | torch | median ratios (target) | record |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in older:
        targeted = [row for row in r["rows"] if row.get("target") is not None]
        rows = "; ".join(
            f"{row['case']}, {row['metric']}: {row['ratio']['median']:.2f} (<= {row['target']:.2f})"
            for row in targeted
        )
        path = Path(r.get("_path", ""))
        link = path.name
        if page_dir is not None and path.name:
            link = f"[{path.name}]({os.path.relpath(path.resolve(), page_dir.resolve())})"
        lines.append(
            f"| {r['kind']} | {r['created']} | {r['machine'].get('torch')} | {rows or '-'} "
            f"| {link} |"
        )
    return "\n".join(lines) + "\n"


# [Note: only cited records are kept]
# Every run writes a record (JSON) and a chart (PNG) into the results folder the
# caller names (the user's cache by default: `default_results_dir`): dozens a day. The
# page cites one record per kind, plus the earlier-torch history; `write_docs`
# copies exactly those, chart included, into ``records/`` beside the page and removes
# any record there the page no longer cites, so the repository holds the evidence
# for each figure shown and nothing else.
RECORDS_DIR = "records"


def _cite(records: list[dict[str, Any]], into: Path) -> None:
    """Copy each record (and its chart) into ``into``; point ``_path`` at the copy."""
    into.mkdir(parents=True, exist_ok=True)
    kept: set[str] = set()
    for record in records:
        src = Path(record["_path"])
        # The record, its chart, and the pictures its rows name (a step-link record's
        # timelines) or draw (a pp record's traced cases), all beside it.
        names = [src.with_suffix(".json").name, src.with_suffix(".png").name]
        names += [row["timeline"] for row in record.get("rows", []) if row.get("timeline")]
        if record.get("kind") == "pp":
            from cadence.bench.pp import timeline_path

            chart = src.with_suffix(".png")
            names += [timeline_path(chart, row["case"]).name
                      for row in record["rows"] if "trace" in row]  # fmt: skip
        for name in names:
            f = src.with_name(name)
            if f.exists():
                dst = into / f.name
                if f.resolve() != dst.resolve():
                    dst.write_bytes(f.read_bytes())
                kept.add(dst.name)
        record["_path"] = str(into / src.name)
    for stale in into.iterdir():
        if stale.suffix in (".json", ".png") and stale.name not in kept:
            stale.unlink()


# [Note: one benchmarks page, generated above and hand-written below]
# The figures are generated, so that no table is edited by hand and goes stale; the
# reading of them (profiles, why a target is missed, the hand-run scripts in bench/)
# is prose a person writes. Both live in one page: `write_docs` regenerates everything
# above the `HAND_WRITTEN` line and keeps the line and everything below it unchanged.
# A fresh clone has an empty results folder, so the records already cited (records/)
# are read too: rerunning one kind never drops the other kinds' figures.
HAND_WRITTEN = "<!-- Hand-written from here on: `cadence bench report` keeps it as it is. -->"


def _hand_written(page: Path) -> str:
    text = page.read_text() if page.exists() else ""
    at = text.find(HAND_WRITTEN)
    return "" if at < 0 else "\n" + text[at:]


def write_docs(results: Path, out: Path) -> Path:
    """Regenerate the page ``out`` from the newest records under ``results`` and those it
    already cites, keeping the records it cites beside it (see [Note: only cited records
    are kept]) and its hand-written part (see [Note: one benchmarks page, generated
    above and hand-written below])."""
    cited = out.parent / RECORDS_DIR
    latest, older = latest_records(results, cited), history(results, cited)
    kept = _hand_written(out)
    _cite([*latest.values(), *older], cited)
    out.write_text(render(latest, out.parent, older) + kept)
    return out
