"""``cadence schedule show`` through add_schedule_subcommand on a tiny parser."""

from __future__ import annotations

import argparse

from cadence.pipeline.cli import add_schedule_subcommand


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cadence")
    add_schedule_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_show_prints_grid_stats_and_writes_png(tmp_path, capsys) -> None:
    png, trace = tmp_path / "s.png", tmp_path / "s.json"
    rc = _run(["schedule", "show", "1f1b", "--pp", "4", "--microbatches", "8", "--out", str(png), "--trace", str(trace)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "rank 3" in out and "makespan 33" in out and "bubble 0.2727" in out
    assert "peak in-flight activations 4" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and trace.stat().st_size > 0


def test_show_interleaved_and_csv(tmp_path, capsys) -> None:
    from cadence.pipeline import generate

    assert _run(["schedule", "show", "interleaved", "--pp", "2", "--microbatches", "4", "--chunks", "2"]) == 0
    assert "channels (2): 0->1, 1->0" in capsys.readouterr().out
    path = tmp_path / "s.csv"
    generate("zbv", 2, 4).to_csv(path)
    assert _run(["schedule", "show", str(path)]) == 0
