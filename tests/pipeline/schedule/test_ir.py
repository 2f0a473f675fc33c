"""IR text form and JSON/CSV round trips (torch-produced files: test_torch_interop.py)."""

from __future__ import annotations

import pytest

from cadence.pipeline.schedule import (
    Action,
    ActionKind,
    Payload,
    Schedule,
    ScheduleValidationError,
    generate,
    lower,
    parse_action,
)

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free


@pytest.mark.parametrize(
    "text",
    ["2F0", "3SEND_F1", "1UNSHARD", "0REDUCE_GRAD", "1RECV_B3", "0I2", "5W7", "0WAIT_REDUCE_GRAD"],
)
def test_torch_action_strings_round_trip(text: str) -> None:
    assert str(parse_action(text)) == text


def test_cadence_suffixes_and_overlap() -> None:
    a = parse_action("0SEND_F3~2#1")
    assert (a.kind, a.stage, a.mb, a.peer_stage, a.payload, a.seq) == (
        ActionKind.SEND,
        0,
        3,
        2,
        Payload.ACT,
        1,
    )
    assert str(a) == "0SEND_F3~2#1"
    ov = parse_action("(0F3;1B1)OVERLAP_F_B")
    assert ov.kind is ActionKind.FB_OVERLAP and [str(s) for s in ov.sub] == ["0F3", "1B1"]
    assert str(ov) == "(0F3;1B1)OVERLAP_F_B"
    assert str(parse_action("3LOCAL_F0~4")) == "3LOCAL_F0~4"


def test_bad_action_text_and_fields() -> None:
    with pytest.raises(ScheduleValidationError, match="cannot parse action"):
        parse_action("0X1")
    with pytest.raises(ValueError, match="needs a microbatch"):
        Action(ActionKind.F, 0)
    with pytest.raises(ValueError, match="takes no microbatch"):
        Action(ActionKind.REDUCE_GRAD, 0, 1)
    with pytest.raises(ValueError, match="needs a payload"):
        Action(ActionKind.SEND, 0, 1)
    with pytest.raises(TypeError, match="must be an ActionKind"):
        Action("F", 0, 0)  # type: ignore[arg-type]


def test_transfer_without_peer_gets_the_implied_neighbour() -> None:
    # torch leaves the peer implicit: activations go to s+1, gradients to s-1.
    assert Action(ActionKind.SEND, 2, 0, payload=Payload.ACT).peer_stage == 3
    assert Action(ActionKind.RECV, 2, 0, payload=Payload.GRAD).peer_stage == 3
    assert Action(ActionKind.SEND, 2, 0, payload=Payload.GRAD) == parse_action("2SEND_B0")


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
    assert [[str(a) for a in r] for r in lowered_back.ranks] == [
        [str(a) for a in r] for r in low.ranks
    ]


def test_json_version_mismatch_is_clear() -> None:
    text = generate("gpipe", 2, 2).to_json().replace('"version": 1', '"version": 99')
    with pytest.raises(ScheduleValidationError, match="IR version 99"):
        Schedule.from_json(text)
    with pytest.raises(ScheduleValidationError, match="missing 'format' marker"):
        Schedule.from_json("{}")
