"""Collectives by point-to-point exchange on gloo: results, isolation, policy, wrappers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cadence import CollectiveAlgorithms
from cadence._groups import exchange as _exchange
from cadence._groups.exchange import ExchangeWork, exchange_all_gather, exchange_all_reduce
from cadence.bench.collectives import crossovers
from cadence.errors import CadenceValueError
from cadence.testing import run_distributed
from tests.foundation import bodies_exchange

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("world", "peers_in_flight"),
    [(2, None), (4, None), (4, 1)],
    ids=["world2", "world4", "world4-one-round-at-a-time"],
)
def test_exchange_matches_rank_order_sum_and_native(
    world: int, peers_in_flight: int | None
) -> None:
    results = run_distributed(
        bodies_exchange.collectives,
        world_size=world,
        timeout=90,
        peers_in_flight=peers_in_flight,
    )
    for r in results:
        # Bit for bit the sum in rank order, on every rank, for fp32 and bf16, SUM and AVG.
        assert all(r["exact_rank_order"].values()), r["exact_rank_order"]
        assert all(r[f"in_place_{d}"] for d in (torch.float32, torch.bfloat16))
        assert all(r[f"all_gather_{d}"] for d in (torch.float32, torch.bfloat16))
        assert r["algorithms_logged"] == ["exchange"]
        # One logged event per logical collective, as with gloo's own.
        assert r["counts"] == {"reduce_scatter": 6, "all_reduce": 4, "all_gather": 2}
        for key, diff in r["diff_native"].items():
            if world == 2:
                assert diff == 0.0, key  # two addends commute: gloo's exact result
            else:
                assert diff <= (0.07 if "bfloat16" in key else 2e-6), (key, diff)


def test_interleaved_exchanges_and_user_messages_match_up() -> None:
    for r in run_distributed(bodies_exchange.interleaved, world_size=3, timeout=60):
        assert r == {
            "ag0": True,
            "ag1": True,
            "rs": True,
            "user": True,
            "completes_without_wait": True,
        }


def test_uncovered_ops_and_layouts_run_natively() -> None:
    for r in run_distributed(bodies_exchange.fallbacks, world_size=2, timeout=60):
        assert r["max"] and r["gathered"]
        assert r["algorithms"] == ["native", "native"]


def test_wrappers_train_identically_with_either_algorithm() -> None:
    for r in run_distributed(bodies_exchange.wrappers, world_size=2, timeout=90):
        assert r["fsdp_exchange_used"] == ["all_gather:exchange", "reduce_scatter:exchange"]
        assert r["fsdp_native_used"] == ["all_gather:native", "reduce_scatter:native"]
        assert r["fsdp_max_diff"] == 0.0
        assert r["dp_max_diff"] == 0.0
        assert "CollectiveAlgorithms" in r["fsdp_type_error"]
        assert "finalize_backward()" in r["dp_pending_error"]
        assert "takes a cadence.CollectiveAlgorithms, got str" in r["dp_type_error"]
        assert "called inside backward" in r["fsdp_in_backward_error"]


def test_finisher_error_is_raised_by_wait_and_completion_still_reported() -> None:
    class FailingWork:
        def wait(self) -> None:
            raise RuntimeError("peer went away")

    def never() -> None:
        raise AssertionError("finish must not run after a failed transfer")

    work = ExchangeWork([lambda: [FailingWork()], never], pg=object())
    with pytest.raises(RuntimeError, match="peer went away"):
        work.wait()
    assert work.is_completed()
    with pytest.raises(RuntimeError, match="peer went away"):  # every wait() says so
        work.wait()


def test_a_failed_post_is_raised_by_wait() -> None:
    def post() -> list[object]:
        raise RuntimeError("connection reset")

    work = ExchangeWork([post], pg=object())
    with pytest.raises(RuntimeError, match="connection reset"):
        work.wait()
    assert work.is_completed()


def test_a_forked_child_starts_its_own_threads() -> None:
    import multiprocessing as mp

    from cadence._groups import exchange as _exchange

    key = object()
    parent = _exchange._group_threads(key)
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()

    def child() -> None:
        work = ExchangeWork([list, list], pg=key)
        work.wait()  # served by threads of this process, not the parent's dead ones
        queue.put(_exchange._group_threads(key) is not parent)

    proc = ctx.Process(target=child)
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0 and queue.get() is True


def test_policy_is_validated_and_scoped_to_gloo_cpu() -> None:
    with pytest.raises(CadenceValueError, match=r"reduce_scatter='ring'.*auto, native, exchange"):
        CollectiveAlgorithms(reduce_scatter="ring")  # type: ignore[arg-type]
    cpu = torch.zeros(1 << 20)
    every = CollectiveAlgorithms("exchange", "exchange", "exchange")
    assert every.uses_exchange("all_reduce", "gloo", cpu, 2)
    assert not every.uses_exchange("reduce_scatter", "nccl", cpu, 2)  # NCCL: never replaced
    assert not every.uses_exchange("reduce_scatter", "gloo", cpu, 1)  # nothing to exchange
    assert not every.uses_exchange("all_reduce", "gloo", torch.empty(4, device="meta"), 2)
    sparse = torch.zeros(4).to_sparse()  # gloo's own sparse all-reduce, whatever the choice
    assert not every.uses_exchange("all_reduce", "gloo", sparse, 2)
    assert not CollectiveAlgorithms.native().uses_exchange("all_gather", "gloo", cpu, 2)


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather", "all_reduce"])
def test_auto_follows_the_crossover_table_by_size_and_world(kind: str) -> None:
    auto = CollectiveAlgorithms()
    for world in _exchange.MEASURED_WORLDS:
        threshold = _exchange.AUTO_CROSSOVER_BYTES[kind][world]
        big = torch.zeros((1 << 26) // 4)  # 64 MiB, above every measured size
        assert auto.uses_exchange(kind, "gloo", big, world) is (threshold is not None)
        if threshold is not None:
            at = torch.zeros(threshold // 4)
            below = torch.zeros(threshold // 4 - 1)
            assert auto.uses_exchange(kind, "gloo", at, world)
            assert not auto.uses_exchange(kind, "gloo", below, world)


def test_auto_between_measured_worlds_uses_the_next_larger_row() -> None:
    table = {"all_gather": {2: None, 4: 100, 8: None}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_exchange, "AUTO_CROSSOVER_BYTES", table)
        assert _exchange.auto_uses_exchange("all_gather", 100, 3)  # world 4's row
        assert not _exchange.auto_uses_exchange("all_gather", 100, 5)  # world 8's row


def test_auto_is_gloos_own_above_the_largest_measured_world() -> None:
    largest = max(_exchange.MEASURED_WORLDS)
    huge = torch.zeros((1 << 26) // 4)
    for kind in ("reduce_scatter", "all_gather", "all_reduce"):
        assert not CollectiveAlgorithms().uses_exchange(kind, "gloo", huge, largest + 1)
        assert not CollectiveAlgorithms().uses_exchange(kind, "gloo", huge, 8192)


def test_auto_table_is_what_the_named_record_measured() -> None:
    """The table is read from a record, not typed in: re-deriving it from the record
    the Note names gives the same table, over the worlds the table claims."""
    record = json.loads((ROOT / _exchange.CROSSOVER_RECORD).read_text())
    assert record["kind"] == "collectives" and not record["quick"] and not record["tiny"]
    assert sorted(record["settings"]["worlds"]) == list(_exchange.MEASURED_WORLDS)
    assert crossovers(record) == _exchange.AUTO_CROSSOVER_BYTES


class _Recorder:
    """A stand-in process group that records each message and its window, and how
    many messages are outstanding (posted, not yet waited)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.window = 0
        self.outstanding = 0
        self.most_outstanding = 0
        self.messages: list[tuple[str, int, int, int]] = []  # (kind, peer, tag, window)

    def _work(self) -> Any:
        self.outstanding += 1
        self.most_outstanding = max(self.most_outstanding, self.outstanding)
        recorder = self

        class Work:
            def wait(self) -> None:
                recorder.outstanding -= 1

        return Work()

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        self.messages.append(("send", peer, tag, self._step))
        return self._work()

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        self.messages.append(("recv", peer, tag, self._step))
        return self._work()

    @property
    def _step(self) -> int:
        # A new window starts whenever nothing is outstanding (the previous one was waited).
        if self.outstanding == 0:
            self.window += 1
        return self.window


@pytest.mark.parametrize("world", [64, 1024])
def test_an_all_reduce_holds_a_bounded_number_of_messages_at_any_world(world: int) -> None:
    pg = _Recorder(rank=world // 3)
    tensor = torch.zeros(world * 2)
    exchange_all_reduce(pg, tensor, pg.rank, world).wait()  # type: ignore[arg-type]
    assert pg.outstanding == 0
    assert pg.most_outstanding == 2 * _exchange.PEERS_IN_FLIGHT
    sends = [peer for kind, peer, tag, _ in pg.messages if kind == "send"]
    assert len(sends) == 2 * (world - 1)  # every peer twice: scatter, then gather


@pytest.mark.parametrize("world", [3, 8, 64])
def test_both_ends_of_every_pair_meet_in_the_same_window(world: int) -> None:
    """gloo matches messages first-in first-out per peer and tag: a rank's message to a
    peer and the peer's receive from it must sit at the same place in both ranks'
    order, which holds when each pair's messages fall in the same window on both."""
    window_of: dict[tuple[str, int, int], int] = {}
    for rank in range(world):
        pg = _Recorder(rank)
        out, shard = torch.zeros(world * 2), torch.zeros(2)
        exchange_all_gather(pg, out, shard, rank, world).wait()  # type: ignore[arg-type]
        peers = sorted(peer for kind, peer, _, _ in pg.messages if kind == "send")
        assert peers == sorted(set(range(world)) - {rank})  # each peer once
        for kind, peer, _, window in pg.messages:
            src, dst = (rank, peer) if kind == "send" else (peer, rank)
            window_of[(kind, src, dst)] = window
    for (kind, src, dst), window in window_of.items():
        if kind == "send":
            assert window_of[("recv", src, dst)] == window, (src, dst)
