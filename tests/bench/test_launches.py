"""`cadence bench step --link calibrated --launches N`: one row from N launches.

[Note: launches, not only repetitions] in `cadence/bench/_launches.py`. Nothing here
times anything: the rows are made by hand, as a launch writes them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from cadence.bench._launches import MAX_LAUNCHES, combine_launches
from cadence.bench.report import _link_tables
from cadence.cli import main
from cadence.errors import CadenceValueError

pytestmark = pytest.mark.primary_lane


def _summary(median: float) -> dict[str, float]:
    return {"median": median, "q1": median - 0.02, "q3": median + 0.02,
            "min": median - 0.1, "max": median + 0.1, "n": 40}  # fmt: skip


def _row(ratio: float, *, compute: float, cadence_ms: float, torch_ms: float, tag: str) -> Any:
    """A calibrated recommender row of one launch, its times in ms."""
    variant = {
        "cadence": cadence_ms, "cadence_sync": cadence_ms, "torch": torch_ms,
        "torch_best": torch_ms,
    }  # fmt: skip
    link: dict[str, Any] = {
        "rate_bps": 2.4e9, "compute_ms": compute, "before_ms": 0.33 * compute,
        "backward_ms": 0.64 * compute, "after_ms": 0.03 * compute, "pieces": 2,
        "shares": [0.5, 0.5], "bytes": {"plain": 0, "cadence": 11 << 20, "torch": 18 << 20},
        "late_bytes": {"cadence": 1 << 20, "torch": 8 << 20},
    }  # fmt: skip
    for v, ms in variant.items():
        wire = 0.38 * compute if v.startswith("cadence") else 0.63 * compute
        link[v] = {
            "wire_ms": wire, "late_wire_ms": 0.02 * compute, "serial_ms": compute + wire,
            "pattern_bound_ms": 1.05 * compute, "cpu_bound_ms": 1.10 * compute,
            "bound_ms": 1.10 * compute, "measured_ms": ms, "cpu_after_ms": 1.6 * compute,
        }  # fmt: skip
    return {
        "case": "recommender", "what": "a tower and a table", "metric": "step time",
        "rate": "calibrated", "ratio": _summary(ratio), "ratio_best": _summary(ratio + 0.02),
        "aa": _summary(1.0), "abs_ms": {"plain": compute, "cadence": cadence_ms,
                                        "torch": torch_ms},
        "losses": {"cadence": [tag]}, "trace": {"cadence": {"tag": tag}},
        "link": link, "load": [1.0, 2.0],
        "link_settings": {"link_rate_asked_bps": 2_400_000_000,
                          "link_rate_measured_bps": 2.4e9},
        "calibration": {"bytes": 18 << 20, "backward_ms": 64.0, "rate_bps": 2_400_000_000},
    }  # fmt: skip


def _three() -> list[dict[str, Any]]:
    return [
        _row(0.85, compute=100.0, cadence_ms=130.0, torch_ms=152.0, tag="a"),
        _row(0.79, compute=102.0, cadence_ms=120.0, torch_ms=152.0, tag="b"),
        _row(0.80, compute=104.0, cadence_ms=124.0, torch_ms=155.0, tag="c"),
    ]


def test_each_figure_is_the_median_over_launches() -> None:
    rows = _three()
    before = copy.deepcopy(rows)
    row = combine_launches(rows)
    assert rows == before  # the launches' own rows are left as they were
    assert row["ratio"] == _summary(0.80) | {"median": 0.80}
    assert row["ratio"]["q1"] == pytest.approx(0.78) and row["ratio"]["n"] == 40
    assert row["ratio_best"]["median"] == pytest.approx(0.82)
    lk = row["link"]
    assert lk["compute_ms"] == 102.0
    assert lk["cadence"]["measured_ms"] == 124.0 and lk["torch"]["measured_ms"] == 152.0
    assert lk["cadence"]["serial_ms"] == pytest.approx(0.38 * 102.0 + 102.0)
    assert lk["bytes"] == {"plain": 0, "cadence": 11 << 20, "torch": 18 << 20}
    assert lk["shares"] == [0.5, 0.5] and lk["pieces"] == 2
    assert row["abs_ms"]["cadence"] == 124.0


def test_the_trace_and_losses_come_from_the_median_launch() -> None:
    """A trace is one step: it comes whole from the launch whose ratio is the median's."""
    row = combine_launches(_three())
    assert row["traced_launch"] == 2  # ratios 0.85, 0.79, 0.80: the median is launch 3's
    assert row["trace"] == {"cadence": {"tag": "c"}} and row["losses"] == {"cadence": ["c"]}
    # An even count takes the lower middle, never a blend of two traces.
    row = combine_launches(_three()[:2])
    assert row["traced_launch"] == 1 and row["trace"]["cadence"]["tag"] == "b"
    assert row["ratio"]["median"] == pytest.approx(0.82)


def test_every_launch_is_kept_beside_the_median() -> None:
    rows = _three()
    row = combine_launches(rows)
    assert [r["ratio"] for r in row["launches"]] == [0.85, 0.79, 0.80]
    assert [r["link"] for r in row["launches"]] == [r["link"] for r in rows]
    assert [r["load"] for r in row["launches"]] == [[1.0, 2.0]] * 3
    one = combine_launches(_three()[:1])
    assert one["ratio"]["median"] == 0.85 and len(one["launches"]) == 1


def _efficiency_by_hand(link: dict[str, Any], variant: str) -> float:
    """(serial - step) / (serial - pattern bound), the bound by today's rule."""
    from cadence.bench._bound import recomputed

    f = link[variant]
    bound = recomputed("recommender", link, variant)
    return (f["serial_ms"] - f["measured_ms"]) / (f["serial_ms"] - bound)


def test_efficiency_is_the_median_of_each_launchs_own() -> None:
    """A ratio of differences is computed per launch, from that launch's compute alone,
    serial time and bound, then its median taken; the efficiency of the medians of
    those times would differ (here by about 0.1)."""
    import statistics

    from cadence.bench.report import _by_todays_bound, _efficiency, _efficiency_of

    rows = _three()
    row = _by_todays_bound(combine_launches(rows))
    own = [_efficiency_by_hand(r["link"], "cadence") for r in rows]
    got = _efficiency(row, "cadence", "pattern_bound_ms")
    assert got == pytest.approx(statistics.median(own))
    of_medians = _efficiency_of(row, "cadence", "pattern_bound_ms")
    assert of_medians is not None and abs(of_medians - got) > 0.05, (of_medians, got)
    # One launch: the row's own figures, as before launches existed.
    single = _by_todays_bound(combine_launches(rows[:1]))
    assert _efficiency(single, "cadence", "pattern_bound_ms") == pytest.approx(own[0])


def test_rows_of_different_cases_are_not_combined() -> None:
    a, b, _ = _three()
    b["case"] = "dense_adamw"
    with pytest.raises(ValueError, match="different cases or rates"):
        combine_launches([a, b])
    b["case"], b["rate"] = "recommender", "4x slower"
    with pytest.raises(ValueError, match="different cases or rates"):
        combine_launches([a, b])
    with pytest.raises(ValueError, match="at least one"):
        combine_launches([])


def test_the_report_judges_the_median_and_prints_every_launch() -> None:
    """The verdict reads the median over launches (0.80 of torch: met), and each launch's
    ratio and efficiency is printed under the table, the traced one marked."""
    record = {
        "created": "2026-12-07T18:00:00Z", "quick": False,
        "machine": {"cpu_count": 2, "torch": "2.15.0"},
        "settings": {"world": 2, "launches": 3},
        "rows": [combine_launches(_three())],
    }  # fmt: skip
    table = _link_tables(record)
    assert "`cadence bench step --link calibrated --launches 3`, 2026" in table
    assert "Every case ran in 3 launches" in table
    (median_line,) = [ln for ln in table.splitlines() if ln.startswith("| recommender | 2.4")]
    assert "<= 0.80 of torch: met" in median_line, median_line
    launch_lines = [ln for ln in table.splitlines() if ln.startswith("| recommender | ")][1:]
    assert [ln.split(" | ")[1:3] for ln in launch_lines] == [
        ["1", "0.85"],
        ["2", "0.79"],
        ["3*", "0.80"],
    ]
    first = _three()[0]["link"]
    cells = (
        f"{_efficiency_by_hand(first, 'cadence'):.2f}, {_efficiency_by_hand(first, 'torch'):.2f}"
    )
    assert f"| {cells} | 100.0 | 1.00 / 2.00 |" in launch_lines[0], launch_lines[0]
    # A record of one launch prints no launch table.
    single = {**record, "settings": {"world": 2}, "rows": [_three()[0]]}
    assert "launch" not in _link_tables(single)


def test_launches_are_refused_where_they_do_not_apply(tmp_path: Path) -> None:
    """Refused before any link is made or anything is written."""
    for argv, why in (
        (["bench", "step", "--launches", "3"], "--launches applies to 'cadence bench step "
         "--link calibrated' only"),
        (["bench", "step", "--link", "2gbit", "--launches", "3"], "--link calibrated' only"),
        (["bench", "dp", "--link", "calibrated", "--launches", "3"], "only"),
        (["bench", "report", "--launches", "2"], "only"),
        (["bench", "step", "--link", "calibrated", "--launches", "0"], "give 1 to"),
        (["bench", "step", "--link", "calibrated", "--launches", str(MAX_LAUNCHES + 1)],
         "give 1 to"),
    ):  # fmt: skip
        with pytest.raises(CadenceValueError, match=why):
            main(["--debug", *argv, "--results", str(tmp_path)])
    assert not list(tmp_path.iterdir())
