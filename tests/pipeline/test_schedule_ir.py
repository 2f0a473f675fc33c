"""IR text form, JSON/CSV round trips, and loading a torch-produced CSV."""

from __future__ import annotations

import csv

import pytest

from cadence.pipeline import (
    Action,
    ActionKind,
    Payload,
    Schedule,
    generate,
    lower,
    parse_action,
    verify,
)


@pytest.mark.parametrize(
    "text", ["2F0", "3SEND_F1", "1UNSHARD", "0REDUCE_GRAD", "1RECV_B3", "0I2", "5W7", "0WAIT_REDUCE_GRAD"]
)
def test_torch_action_strings_round_trip(text: str) -> None:
    assert str(parse_action(text)) == text


def test_cadence_suffixes_and_overlap() -> None:
    a = parse_action("0SEND_F3~2#1")
    assert (a.kind, a.stage, a.mb, a.peer_stage, a.payload, a.seq) == (ActionKind.SEND, 0, 3, 2, Payload.ACT, 1)
    assert str(a) == "0SEND_F3~2#1"
    ov = parse_action("(0F3;1B1)OVERLAP_F_B")
    assert ov.kind is ActionKind.FB_OVERLAP and [str(s) for s in ov.sub] == ["0F3", "1B1"]
    assert str(ov) == "(0F3;1B1)OVERLAP_F_B"
    assert str(parse_action("3LOCAL_F0~4")) == "3LOCAL_F0~4"


def test_bad_action_text_and_fields() -> None:
    with pytest.raises(ValueError, match="cannot parse action"):
        parse_action("0X1")
    with pytest.raises(ValueError, match="needs a microbatch"):
        Action(ActionKind.F, 0)
    with pytest.raises(ValueError, match="takes no microbatch"):
        Action(ActionKind.REDUCE_GRAD, 0, 1)
    with pytest.raises(ValueError, match="needs a payload"):
        Action(ActionKind.SEND, 0, 1)


def test_actions_are_hashable_and_frozen() -> None:
    a = parse_action("2F0")
    assert {a: 1}[Action(ActionKind.F, 2, 0)] == 1
    with pytest.raises(AttributeError):
        a.stage = 3  # type: ignore[misc]


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zbv", "dualpipev"])
def test_json_and_csv_round_trip(name: str, tmp_path) -> None:
    s = generate(name, 2, 4)
    low = lower(s)
    assert Schedule.from_json(low.to_json()) == low
    path = tmp_path / "s.json"
    low.to_json(path)
    assert Schedule.from_json(path) == low
    back = Schedule.from_csv(s.to_csv(), generator=name)
    assert back.ranks == s.ranks and back.placement == s.placement
    lowered_back = Schedule.from_csv(low.to_csv(), low.placement)
    assert [[str(a) for a in r] for r in lowered_back.ranks] == [[str(a) for a in r] for r in low.ranks]


def test_json_version_mismatch_is_clear() -> None:
    text = generate("gpipe", 2, 2).to_json().replace('"version": 1', '"version": 99')
    with pytest.raises(ValueError, match="IR version 99"):
        Schedule.from_json(text)


def test_load_torch_produced_compute_csv(tmp_path) -> None:
    # The exact _dump_csv format: one row per rank, action strings, None -> empty cell.
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    order = get_schedule_ops("InterleavedZeroBubble", 2, 4, 2, add_spacing=True)
    path = tmp_path / "zb1p_2rank_2stagep_compute.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for row in order:
            writer.writerow(row)
    if any(a is None for row in order for a in row):
        assert ",," in path.read_text() or ",\n" in path.read_text()  # idle = empty cell
    s = Schedule.from_csv(path)
    assert s.placement == (0, 1, 0, 1) and s.meta.m == 4
    result = verify(lower(s))
    assert result.makespan > 0
    # Export back: every cell parses with torch's _Action.from_str.
    from torch.distributed.pipelining.schedules import _Action

    for row in csv.reader(s.to_csv().splitlines()):
        for cell in row:
            assert str(_Action.from_str(cell)) == cell
