"""The pipeline setup vote: by digest on the happy path, precise when ranks differ.

Specification (world 4: pp=2 x dp_replicate=2, gloo):
- a pipeline build votes with one ``agree`` on the setup group (an all-reduce of
  144 bytes: the plan/options/pp-groups digest and two flags), whatever the world
  size, and runs no object collective (nothing a peer sends is unpickled);
- ranks whose options differ raise `PlanMismatchError` on every rank, naming every
  rank's options;
- a rank naming other pp groups than the ranks' own pp ranks makes every rank raise,
  naming that rank and the real groups; the details travel only then (two
  all-gathers of JSON);
- a rank that cannot tell the pp groups (given none, its pipeline is not the world)
  makes the ranks exchange their pp ranks, and every rank creates the same groups;
- a local error on one rank is raised on every rank, naming that rank;
- ranks whose plans differ raise on every rank, naming the rank, its pp ranks and
  the channels only one side has.
"""

from __future__ import annotations

import pytest

from cadence.testing import run_distributed
from tests.pipeline.runtime.bodies_setup_vote import body_setup_vote


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(body_setup_vote, world_size=4, timeout=180)


@pytest.mark.slow
def test_happy_path_is_one_fixed_size_vote(results) -> None:
    for res in results:
        assert "agree" in res["happy_kinds"], res["happy_kinds"]
        assert not {k for k in res["happy_kinds"] if "gather" in k}, res["happy_kinds"]
        assert res["happy_agree_bytes"] == [8 * (16 + 2)]
        assert res["happy_objects"] == 0


@pytest.mark.slow
def test_options_that_differ_are_named_on_every_rank(results) -> None:
    for res in results:
        msg = res["options"]
        assert msg.startswith("PlanMismatchError: pipeline setup failed"), msg
        assert "rank 0: pipeline options differ across ranks: ('opt', 0)" in msg, msg
        assert "rank 3: pipeline options differ across ranks: ('opt', 1)" in msg, msg


@pytest.mark.slow
def test_wrong_pp_groups_are_named_on_every_rank(results) -> None:
    for res in results:
        msg = res["pp_groups"]
        assert msg.startswith("PlanMismatchError"), msg
        assert "differ from their pp ranks [[0, 2], [1, 3]]" in msg, msg
        assert "rank 0: pp groups [[0, 2], [3, 1]]" in msg and "rank 1:" not in msg, msg
        assert res["pp_groups_details"] == 2


@pytest.mark.slow
def test_a_rank_without_pp_groups_gets_them_from_the_others(results) -> None:
    for res in results:
        assert res["unknown_groups"] == [[0, 2], [1, 3]]


@pytest.mark.slow
def test_local_error_raised_everywhere(results) -> None:
    for res in results:
        msg = res["local_error"]
        assert "pipeline setup failed" in msg and "rank 2: rank 2 refused" in msg, msg


@pytest.mark.slow
def test_plans_that_differ_are_described_on_every_rank(results) -> None:
    for res in results:
        msg = res["plans"]
        assert "plans differ" in msg and "rank 1 (pp ranks [1, 3])" in msg, msg
        assert "channels only on rank 0: 1->0" in msg, msg
