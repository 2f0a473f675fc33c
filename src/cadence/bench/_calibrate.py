"""``cadence bench step --link calibrated``: every case at the rate where its wire time
equals its backward compute, and at a rate 4x slower.

[Note: the calibrated rate]
A link much faster than a case's backward leaves nothing to hide, a much slower one
leaves nothing but the wire: the comparison that tells timing apart is where the two
are equal. One short pass in an unshaped namespace (the loopback counted, not
shaped) measures each case's bytes per step (the larger of cadence's and torch's
variant's; for the pipeline the data-parallel reduction's only) and its backward
compute (the ``plain`` variant's last backward; for the pipeline two thirds of its
schedule, backward being about twice a forward). The calibrated rate is bytes * 8 /
backward, to two significant digits. The larger side's bytes: where one side moves
fewer (fully_shard's exchange reduce-scatter, the recommender's exchange of lookups),
a rate set by the smaller would put the other's wire well above its backward, and
the comparison would favour the side that set it. Each case then runs on a link of
its own at that rate and at a quarter of it, and the rows land in one ``step-link``
record: one table per rate in ``docs/benchmarks.md``. With ``--launches N`` each case
runs N times at each rate and its row is their median (`cadence.bench._launches`).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

from cadence.bench._launches import check_launches, combine_launches
from cadence.bench._loop import loadavg
from cadence.bench._on_link import check_not_inside, inner_argv
from cadence.bench._record import make_record, write_record

__all__ = ["KIND", "RATES", "calibrated_rate", "run_calibrated"]

KIND = "step-link"
RATES = (("calibrated", 1), ("4x slower", 4))
_CALIBRATION_REPS = "2,4"  # warmup, reps: bytes and backward time, not a ratio


def calibrated_rate(row: dict[str, Any]) -> tuple[int, float, int]:
    """(rate in bit/s, backward ms, bytes) of [Note: the calibrated rate] from a row
    taken on an unshaped link."""
    link = row["link"]
    nbytes = max(link["bytes"]["cadence"], link["bytes"]["torch"])
    if row["case"] == "pipeline":
        nbytes -= link["bytes"]["plain"]
        backward = 2 / 3 * link["before_ms"]
    else:
        backward = link["backward_ms"]
    raw = 8 * nbytes / (backward / 1e3)
    digits = 10 ** (math.floor(math.log10(raw)) - 1)
    return max(1_000_000, round(raw / digits) * digits), backward, nbytes


def _newest(folder: Path) -> dict[str, Any]:
    paths = sorted(folder.glob("step-*.json"))
    if not paths:
        raise RuntimeError(f"the run inside the link wrote no record into {folder}")
    record: dict[str, Any] = json.loads(paths[-1].read_text())
    return record


def _launch_row(
    out: Path, name: str, label: str, calibration: tuple[int, float, int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One launch's row, from the record its run wrote into ``out``, and the run's
    settings but the link's (which the row keeps)."""
    nbytes, backward, rate = calibration
    record = _newest(out)
    row: dict[str, Any] = record["rows"][0]
    row["rate"] = label
    row["calibration"] = {"bytes": nbytes, "backward_ms": backward, "rate_bps": rate}
    row["link_settings"] = {k: v for k, v in record["settings"].items() if k.startswith("link")}
    row["load"] = [record["machine"]["loadavg_before"][0], record["machine"]["loadavg"][0]]
    pictures = sorted(out.glob(f"step-*-{name}-timeline.png"))
    row["_timeline_src"] = str(pictures[-1]) if pictures else None
    settings = {k: v for k, v in record["settings"].items() if not k.startswith("link")}
    return row, settings


def run_calibrated(
    *, quick: bool, results: Path, cases: list[str] | None, launches: int = 1
) -> int:
    """Calibrate, then run every case at both rates, each ``launches`` times ([Note:
    launches, not only repetitions] in `cadence.bench._launches`); its exit status."""
    from cadence.bench._run import format_rows
    from cadence.bench.step import CASES
    from cadence.link import EmulatedLink, LinkSpec

    check_not_inside()
    check_launches(launches, calibrated=True)
    names = cases or list(CASES)
    load0 = loadavg()
    with tempfile.TemporaryDirectory(prefix="cadence-calibrate-") as tmp:
        work = Path(tmp)
        with EmulatedLink(LinkSpec(None)) as counting:
            rc = counting.run(
                inner_argv("step", quick=True, results=work / "calibration", cases=names),
                env={"CADENCE_BENCH_REPS": _CALIBRATION_REPS},
            )
        if rc:
            return rc
        calibration = {
            row["case"]: calibrated_rate(row) for row in _newest(work / "calibration")["rows"]
        }
        rows: list[dict[str, Any]] = []
        settings: dict[str, Any] = {}
        for name in names:
            rate, backward, nbytes = calibration[name]
            for label, factor in RATES:
                spec = LinkSpec(rate // factor)
                runs: list[dict[str, Any]] = []
                for launch in range(launches):
                    out = work / f"{name}-{factor}-{launch}"
                    with EmulatedLink(spec) as link:
                        which = f" (launch {launch + 1} of {launches})" if launches > 1 else ""
                        print(f"{name}, {label}{which}: " + link.self_check().line(spec),
                              flush=True)  # fmt: skip
                        rc = link.run(inner_argv("step", quick=quick, results=out, cases=[name]))
                    if rc:
                        return rc
                    row, settings = _launch_row(out, name, label, (nbytes, backward, rate))
                    runs.append(row)
                rows.append(combine_launches(runs))
        settings["launches"] = launches
        record = make_record(KIND, quick=quick, rows=rows, load_before=load0, settings=settings)
        path = write_record(record, results)
        # Each case's timeline, beside the record under its name: the report cites them
        # with it.
        for row in rows:
            src = row.pop("_timeline_src")
            if src is not None:
                factor = dict(RATES)[row["rate"]]
                dst = path.with_name(f"{path.stem}-{row['case']}-{factor}x-timeline.png")
                shutil.copyfile(src, dst)
                row["timeline"] = dst.name
        write_record(record, results)
    print(format_rows(record))
    print(f"record: {path}")
    return 0
