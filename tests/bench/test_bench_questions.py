"""`cadence bench`'s further questions (``dp --finalize-patterns``, ``pp --bubbles``, ...)
at tiny sizes: what each writes, where, and that the page leaves it off.

Each question runs once at a tiny size and must write its record, in the record
format, into the folder it was given and nowhere else. Nothing is asserted on a
time: the figures of a tiny run are meaningless. What is checked is the record's
kind, rows and keys, and that every ratio is a finite number.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from cadence.bench import format_rows, run_bench
from cadence.bench._record import make_record
from cadence.bench._run import QUESTIONS
from cadence.bench.report import latest_records
from cadence.cli import main
from cadence.errors import CadenceValueError

# Benchmarks measure against the primary torch: see [Note: benchmark tests run on the
# primary lane only] in tests/conftest.py.
pytestmark = pytest.mark.primary_lane

SUMMARY_KEYS = {"median", "min", "max", "q1", "q3", "n"}


def _check(record: dict[str, Any], path: Path, folder: Path, kind: str) -> None:
    """The record is in ``folder`` (only there), of ``kind``, with finite ratios."""
    assert path.parent == folder and path.name.startswith(f"{kind}-")
    assert json.loads(path.read_text()) == record
    assert record["kind"] == kind and record["tiny"] is True
    assert len(record["machine"]["loadavg_before"]) == 3
    assert record["rows"]
    for row in record["rows"]:
        assert {"case", "metric", "ratio", "aa", "target"} <= set(row), row
        for summary in (row["ratio"], row["aa"]):
            if summary is not None:
                assert set(summary) == SUMMARY_KEYS
                assert all(math.isfinite(summary[k]) for k in SUMMARY_KEYS), row
        numbers = [v for v in row.get("extra", {}).values() if isinstance(v, (int, float))]
        assert all(math.isfinite(v) for v in numbers), row
    assert "ratio = " in format_rows(record)
    # A question's record never stands in for its comparison on the page.
    assert latest_records(folder) == {}
    assert latest_records(_as_real(record, folder)) == {}


def _as_real(record: dict[str, Any], folder: Path) -> Path:
    """The record again, as a full (not tiny) run would write it, in a folder of its own."""
    real = folder / "real"
    real.mkdir()
    (real / "record.json").write_text(json.dumps(dict(record, tiny=False, quick=False)))
    return real


@pytest.mark.timeout(300)
def test_dp_finalize_patterns_with_profile(tmp_path: Path) -> None:
    record, path, _ = run_bench(
        "dp", tiny=True, question="finalize-patterns", out_dir=tmp_path, profile=True
    )
    _check(record, path, tmp_path, "dp-finalize-patterns")
    cases = [r["case"] for r in record["rows"]]
    assert cases == ["no task", "pattern (a) vs auto", "pattern (a) vs torch"]
    plain, vs_auto, _ = record["rows"]
    assert set(plain["abs_ms"]) == {"plain", "cadence", "torch", "torch_b"}
    assert {"exposed_comm_cadence", "blocked_in_wait_cadence", "cores_busy_torch"} <= set(
        plain["extra"]
    )
    assert set(vs_auto["abs_ms"]) == {"auto", "manual", "torch", "torch_b"}
    assert vs_auto["extra"]["task_matmuls"] >= 1
    assert vs_auto["extra"]["blocked_in_wait_manual"] >= 0
    assert vs_auto["ratio"]["n"] == 2
    profiles = record["profiles"]
    assert len(profiles) == 2 and all("function calls" in t for t in profiles.values())
    assert "--- cProfile, rank 0, 10 cadence steps" in format_rows(record)


@pytest.mark.timeout(300)
def test_fsdp_memtracker(tmp_path: Path) -> None:
    record, path, _ = run_bench("fsdp", tiny=True, question="memtracker", out_dir=tmp_path)
    _check(record, path, tmp_path, "fsdp-memtracker")
    step, memory = record["rows"]
    assert step["metric"] == "step time" and step["target"] == 0.70
    assert memory["metric"] == "peak memory (MemTracker)" and memory["ratio"]["n"] == 2
    assert set(memory["abs_mib"]) == {"cadence", "torch", "torch_b", "data_parallel"}
    assert all(v > 0 for v in memory["abs_mib"].values())
    assert memory["extra"]["cadence_over_data_parallel"] > 0


@pytest.mark.timeout(300)
def test_pp_bubbles(tmp_path: Path) -> None:
    record, path, _ = run_bench("pp", tiny=True, question="bubbles", out_dir=tmp_path)
    _check(record, path, tmp_path, "pp-bubbles")
    cases = [r["case"] for r in record["rows"]]
    assert cases == [
        f"world 2 {s}" for s in ("gpipe v=1", "1f1b v=1", "interleaved v=2", "zbv v=2")
    ]
    for row in record["rows"]:
        extra = row["extra"]
        assert set(extra) == {"bubble_cadence", "bubble_torch", "bubble_sim", "bubble_theory"}
        assert 0 <= extra["bubble_sim"] < 1 and 0 <= extra["bubble_theory"] < 1
        assert extra["bubble_cadence"] < 1 and extra["bubble_torch"] < 1
    # 1F1B's closed form at p = 2, m = 4: (p-1)/(m+p-1).
    assert record["rows"][1]["extra"]["bubble_theory"] == pytest.approx(1 / 5)
    assert record["settings"]["source"] == "cadence" and record["settings"]["skipped"] == {}


@pytest.mark.timeout(300)
def test_pp_batch_p2p(tmp_path: Path) -> None:
    record, path, _ = run_bench("pp", tiny=True, question="batch-p2p", out_dir=tmp_path)
    _check(record, path, tmp_path, "pp-batch-p2p")
    modes = {r["case"].split(", ")[1] for r in record["rows"]}
    assert modes == {"per_directed_edge", "shared"}
    for row in record["rows"]:
        assert set(row["abs_ms"]) == {"single", "batched"}
        # Batching merges consecutive posts: never more calls than single posts.
        assert 0 < row["extra"]["posts_batched"] <= row["extra"]["posts_single"]


@pytest.mark.timeout(300)
def test_pickle_loads_dill_out_of_band(tmp_path: Path) -> None:
    pytest.importorskip("dill")
    record, path, _ = run_bench(
        "pickle",
        tiny=True,
        question="extended",
        out_dir=tmp_path,
        loads=True,
        dill=True,
        out_of_band=True,
    )
    _check(record, path, tmp_path, "pickle-extended")
    metrics = {(r["case"], r["metric"]) for r in record["rows"]}
    assert ("small closure", "loads time") in metrics
    assert ("small closure [dill]", "dumps time") in metrics
    tensor = "torch tensor 1 MB (protocol 5, oob)"
    assert (tensor, "payload size (in band)") in metrics
    size = next(
        r for r in record["rows"] if r["case"] == tensor and r["metric"].startswith("payload")
    )
    # cadence keeps the tensor's bytes out of band: the in-band payload is tiny.
    assert size["extra"]["oob_bytes"] == 1 << 20 and size["extra"]["bytes"] < 4096
    assert record["settings"]["failed"] == {"memoryview 1 MB (protocol 5, oob), dill": "TypeError"}


@pytest.mark.timeout(300)
def test_precompile_variant(tmp_path: Path) -> None:
    record, path, _ = run_bench(
        "precompile", tiny=True, out_dir=tmp_path, shared_inductor_cache=True, ship_kernels=False
    )
    _check(record, path, tmp_path, "precompile-variant")
    assert record["settings"]["inductor_cache"] == "one cold per run"
    assert record["settings"]["ship_kernels"] is False
    assert record["rows"][0]["extra"]["sources"] == "compiled,received"


def test_cli_maps_flags_to_questions_and_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    def fake(kind: str, **kw: Any) -> tuple[dict[str, Any], Path, None]:
        calls.append((kind, kw))
        row = {"case": "c", "metric": "m", "ratio": None, "aa": None, "target": None}
        record = make_record(kind, quick=False, rows=[row], load_before=[0, 0, 0], settings={})
        return record, kw["out_dir"] / "r.json", None

    monkeypatch.setattr("cadence.bench.run_bench", fake)
    out = ["--results", str(tmp_path)]
    runs = {
        ("dp", "--finalize-patterns", "--profile", "--nproc", "3", "--width", "8"): (
            "finalize-patterns",
            {"profile": True, "world": 3, "width": 8},
        ),
        ("fsdp", "--memtracker", "--layers", "2", "--batch", "4"): (
            "memtracker",
            {"layers": 2, "batch": 4},
        ),
        ("pp", "--bubbles", "--source", "torch"): ("bubbles", {"source": "torch"}),
        ("pp", "--batch-p2p", "--nproc", "4"): ("batch-p2p", {"world": 4}),
        ("pickle", "--dill"): ("extended", {"loads": False, "dill": True, "out_of_band": False}),
        ("precompile", "--nproc", "4", "--shared-inductor-cache", "--no-ship-kernels"): (
            None,
            {"world": 4, "shared_inductor_cache": True, "ship_kernels": False},
        ),
        ("dp",): (None, {}),
    }
    for argv, (question, options) in runs.items():
        assert main(["bench", *argv, *out]) == 0
        kind, kw = calls.pop()
        assert kind == argv[0] and kw.pop("question") == question, argv
        assert kw.pop("out_dir") == tmp_path and kw.pop("quick") is False
        assert kw == options, argv
    assert f"record: {tmp_path / 'r.json'}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["pp", "--memtracker"], "--memtracker applies to 'cadence bench fsdp', not 'pp'"),
        (["pp", "--bubbles", "--batch-p2p"], "--batch-p2p and --bubbles are two runs"),
        (["dp", "--nproc", "4"], "--nproc does not apply to 'cadence bench dp'; it goes with"),
        (["pp", "--batch-p2p", "--layers", "3"], "--layers does not apply to 'cadence bench pp --batch-p2p'"),
        (["dp", "--profile"], "it goes with 'cadence bench dp --finalize-patterns'"),
        (["fsdp", "--memtracker", "--link", "1gbit"], "--link runs a comparison as it is"),
        (["report", "--dill"], "--dill applies to 'cadence bench pickle', not 'report'"),
    ],
)  # fmt: skip
def test_cli_refuses_a_flag_that_does_not_apply(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    with pytest.raises(CadenceValueError, match=message.replace("(", r"\(")):
        main(["--debug", "bench", *argv, "--results", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written


def test_every_question_belongs_to_a_comparison() -> None:
    with pytest.raises(CadenceValueError, match="has no question 'bubbles'; it has finalize"):
        run_bench("dp", question="bubbles", out_dir=Path("unused"))
    assert {q.kind for q in QUESTIONS.values()} == {"dp", "fsdp", "pp", "pickle"}
