"""``cadence schedule show`` through the one ``cadence`` parser (no process group)."""

from __future__ import annotations

import pytest

from cadence.cli import main
from cadence.pipeline.schedule import Schedule, add_comms, generate


def test_show_prints_grid_stats_and_writes_png(tmp_path, capsys) -> None:
    png, trace = tmp_path / "s.png", tmp_path / "s.json"
    argv = ["schedule", "show", "1f1b", "--pp", "4", "--microbatches", "8"]
    rc = main([*argv, "--out", str(png), "--trace", str(trace)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "rank 3" in out and "makespan 33" in out and "bubble 0.2727" in out
    assert "peak in-flight activations 4" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and trace.stat().st_size > 0


def test_show_interleaved_and_csv(tmp_path, capsys) -> None:
    argv = ["schedule", "show", "interleaved", "--pp", "2", "--microbatches", "4", "--chunks", "2"]
    assert main(argv) == 0
    assert "channels (2): 0->1, 1->0" in capsys.readouterr().out
    path = tmp_path / "s.csv"
    generate("zbv", 2, 4).to_csv(path)
    assert main(["schedule", "show", str(path)]) == 0
    assert "csv: p=2, stages=4, m=4" in capsys.readouterr().out


def test_show_reports_a_deadlock(tmp_path, capsys) -> None:
    # Receives posted just before their consumers (add_comms alone) hang on shared
    # communicators for interleaved on 4 ranks (see test_sim.py).
    path = tmp_path / "low.json"
    add_comms(generate("interleaved", 4, 8, 2)).to_json(path)
    assert Schedule.from_json(path).meta.lowered
    assert main(["schedule", "show", str(path), "--mode", "shared"]) == 2
    assert "simulator rejects the schedule" in capsys.readouterr().err


def test_unknown_schedule_is_named(capsys) -> None:
    with pytest.raises(ValueError, match="unknown schedule 'nope'"):
        main(["schedule", "show", "nope", "--debug"])  # --debug: raise, not one line


def test_compare_prints_the_table_against_torch(capsys) -> None:
    pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    assert main(["schedule", "compare", "zbv", "dualpipev", "--pp", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert "cadence / torch" in out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith(("zbv", "dualpipev"))}
    assert "25.5 / 25.5" in lines["zbv"] and lines["zbv"].endswith("<=")
    assert "27 / 27" in lines["dualpipev"] and lines["dualpipev"].endswith("<=")
    assert "no worse than torch (both makespans and peak) in 2 of 2" in out
