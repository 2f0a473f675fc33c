"""``cadence.pipelining`` as a drop-in for ``torch.distributed.pipelining``.

Specification: torch's pipelining tutorial (its ``Transformer``, scaled down, dropout
kept), run with torch's module and with cadence's on the same two ranks and seeds
in one launch, gives the same per-microbatch losses, the same merged output and
the same parameters after three SGD steps, and the same losses from a following
``eval``, bit for bit (``torch.equal``), for:

- the manual split with ``PipelineStage`` (torch's signature) under ``ScheduleGPipe``
  and ``Schedule1F1B``;
- the tracer split (``pipeline(...)`` + ``pipe.build_stage``), through cadence's
  ``pipeline`` and through torch's own (torch's ``_PipelineStage`` handed to
  cadence's schedule);
- two stages per rank (four stages) under ``ScheduleInterleaved1F1B``,
  ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``
  and ``ScheduleDualPipeV``.

The loss entries carry a ``grad_fn`` exactly where torch's do, and what ran is
cadence's lowered schedule from the generator torch's class maps to, on per-edge
channels.
"""

from __future__ import annotations

import pytest
import torch

from cadence.testing import run_distributed
from tests.pipelining.bodies_compat import STEPS, V_SHAPED, body_both, body_subgroup_refused

CONFIGS = [
    ("manual", "ScheduleGPipe", 1),
    ("manual", "Schedule1F1B", 1),
    ("tracer", "ScheduleGPipe", 1),
    ("torch_tracer", "ScheduleGPipe", 1),
    ("manual", "ScheduleInterleaved1F1B", 2),
    ("manual", "ScheduleLoopedBFS", 2),
    ("manual", "ScheduleInterleavedZeroBubble", 2),
    ("manual", "ScheduleZBVZeroBubble", 2),
    ("manual", "ScheduleDualPipeV", 2),
]
GENERATOR = {
    "ScheduleGPipe": "gpipe",
    "Schedule1F1B": "1f1b",
    "ScheduleInterleaved1F1B": "interleaved",
    "ScheduleLoopedBFS": "looped_bfs",
    "ScheduleInterleavedZeroBubble": "zb_h1",
    "ScheduleZBVZeroBubble": "zbv",
    "ScheduleDualPipeV": "dualpipev",
}
CADENCE_STAGE = "cadence.pipelining.stage.PipelineStage"
TORCH_TRACED_STAGE = "torch.distributed.pipelining.stage._PipelineStage"
IDS = [f"{split}-{name}" for split, name, _ in CONFIGS]


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str, int], list[dict]]:
    """One world-2 launch: every config, torch's run then cadence's; per config, per rank."""
    results = run_distributed(body_both, CONFIGS, world_size=2, timeout=240)
    return {c: [r[f"config={c}"] for r in results] for c in CONFIGS}


def _last_rank(rows: list[dict]) -> dict:
    (row,) = [r for r in rows if r["torch"]["losses"][0] is not None]
    return row


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_losses_equal_torchs_bit_for_bit(runs, config) -> None:
    row = _last_rank(runs[config])
    for step in range(STEPS):
        t, c = row["torch"]["losses"][step], row["cadence"]["losses"][step]
        assert c is not None and torch.equal(c, t), (step, t, c)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_parameters_after_the_steps_equal_torchs_bit_for_bit(runs, config) -> None:
    for rank, row in enumerate(runs[config]):
        t, c = row["torch"]["params"], row["cadence"]["params"]
        assert len(t) == len(c) > 0
        assert all(torch.equal(a, b) for a, b in zip(t, c)), rank


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_step_returns_torchs_merged_output_on_the_last_stage(runs, config) -> None:
    row = _last_rank(runs[config])
    t, c = row["torch"]["outputs"], row["cadence"]["outputs"]
    assert len(c) == STEPS and all(torch.equal(a, b) for a, b in zip(t, c))


# torch's eval() raises on its V schedules ("can't steal_bwd_input"), so those are
# not compared.
EVAL_CONFIGS = [c for c in CONFIGS if c[1] not in V_SHAPED]


@pytest.mark.parametrize("config", EVAL_CONFIGS, ids=[IDS[CONFIGS.index(c)] for c in EVAL_CONFIGS])
def test_eval_losses_equal_torchs_bit_for_bit(runs, config) -> None:
    row = _last_rank(runs[config])
    t, c = row["torch"]["eval_losses"], row["cadence"]["eval_losses"]
    assert t is not None and c is not None and torch.equal(c, t), (t, c)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_loss_entries_have_a_grad_fn_where_torchs_do(runs, config) -> None:
    for row in runs[config]:
        assert row["cadence"]["loss_has_grad_fn"] == row["torch"]["loss_has_grad_fn"]
    # not vacuous: four losses per step; a full backward leaves each its graph, an
    # input-half backward (zero bubble) detaches it, in torch and in cadence
    flags = _last_rank(runs[config])["cadence"]["loss_has_grad_fn"]
    assert [len(f) for f in flags] == [4] * STEPS
    if config[1] in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"):
        assert flags == [[True] * 4] * STEPS


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_the_output_has_a_grad_fn_where_torchs_does(runs, config) -> None:
    row = _last_rank(runs[config])
    assert row["cadence"]["output_has_grad_fn"] == row["torch"]["output_has_grad_fn"]


def test_the_compared_model_draws_dropout(runs) -> None:
    # bitwise equality above includes dropout masks, not a model without randomness
    assert all(r[api]["dropout_live"] for rows in runs.values() for r in rows for api in r)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_what_ran_is_cadences_lowered_schedule_on_per_edge_channels(runs, config) -> None:
    for row in runs[config]:
        c = row["cadence"]
        assert c["ran_generator"] == GENERATOR[config[1]]
        assert c["ran_lowered"] is True
        assert c["channels"] == [(0, 1), (1, 0)]
        assert c["ran_stage_types"] == [CADENCE_STAGE] * config[2]


def test_torchs_traced_stage_is_taken_by_cadences_schedule(runs) -> None:
    for row in runs[("torch_tracer", "ScheduleGPipe", 1)]:
        # the script built torch's _PipelineStage; cadence's schedule ran it as its own
        assert row["cadence"]["script_stage_types"] == [TORCH_TRACED_STAGE]
        assert row["cadence"]["ran_stage_types"] == [CADENCE_STAGE]


def test_a_stage_over_part_of_the_world_is_refused_with_the_fix() -> None:
    messages = run_distributed(body_subgroup_refused, world_size=2, timeout=60)
    for m in messages:
        assert "group= has ranks [0], not the whole world" in m
        assert "build_pipeline(..., groups=...)" in m
