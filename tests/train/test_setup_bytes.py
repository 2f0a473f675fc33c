"""What each rank sends and receives at setup and at the end of a run, at world 2, 4, 8.

Bytes are counted through each step's `EventLog`: every collective's buffer (what a
rank sends, or receives into). Gloo on CPU, pp=2 x dp_replicate=world/2, tiny models.

Specification:
- a pipeline build (the plan vote and the preconnect), fully_shard's construction
  and precompile's key agreement cost each rank the same bytes at every world size
  (within 16 bytes), and run no object collective (nothing a peer sends is
  unpickled);
- precompile's agreement on a cache hit everywhere is one ``agree`` and says so;
- the end-of-run report reaches rank 0 alone: another rank sends 8 bytes of size
  and its own report (the same bytes at every world), rank 0 receives world x the
  longest report, and every report arrives intact;
- ``Comm.agree`` tells every rank that one rank's digest differs and which flags
  some rank set; ``gather_bytes`` and ``all_gather_bytes`` return every rank's
  bytes, empty ones included, in rank order;
- DataParallel's construction checks that every rank wraps the same parameters by a
  digest vote too: no object collective, the same bytes at every world size.
"""

from __future__ import annotations

import json

import pytest

from cadence.testing import run_distributed
from tests.train.bodies_setup_bytes import REPORT, body_setup_bytes

WORLDS = (2, 4, 8)
SLACK = 16  # bytes: the same plan may differ by a message or two of 4 bytes
PER_RANK = ("pipeline", "fully_shard", "precompile", "data_parallel")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def by_world() -> dict[int, list[dict]]:
    # World 8 on two cores: setup only, so a generous timeout is enough.
    return {w: run_distributed(body_setup_bytes, world_size=w, timeout=300) for w in WORLDS}


@pytest.mark.parametrize("step", PER_RANK)
def test_setup_bytes_per_rank_do_not_grow_with_the_world(by_world, step: str) -> None:
    base = max(res[step]["bytes"] for res in by_world[2])
    for world, results in by_world.items():
        for rank, res in enumerate(results):
            got = res[step]
            assert abs(got["bytes"] - base) <= SLACK, (step, world, rank, got, base)
            assert got["objects"] == 0, (step, world, rank, got)
            assert not any("gather" in k for k in got["kinds"]), (step, world, rank, got)


def test_precompile_agreement_is_one_vote(by_world) -> None:
    for results in by_world.values():
        for res in results:
            assert res["precompile"]["kinds"] == ["agree"] and res["precompile"]["all_hit"]


def test_report_goes_to_rank0_alone_within_a_bound(by_world) -> None:
    size = 8 + len(json.dumps(REPORT).encode())
    for world, results in by_world.items():
        assert results[0]["report"]["got"] == [REPORT] * world
        assert results[0]["report"]["bytes"] == 8 + world * size
        for res in results[1:]:
            assert res["report"]["got"] is None
            assert res["report"]["bytes"] == 8 + size, (world, res["report"])
            assert res["report"]["objects"] == 0


def test_comm_agreement_and_byte_helpers(by_world) -> None:
    for world, results in by_world.items():
        for rank, res in enumerate(results):
            assert res["agree"] == [False, [True, False]], (world, rank)
            assert res["all_gather_bytes"] == [b"y" * (world - r) for r in range(world)]
        assert results[0]["gather_bytes"] == [b"x" * r for r in range(world)]
        assert all(res["gather_bytes"] is None for res in results[1:])
