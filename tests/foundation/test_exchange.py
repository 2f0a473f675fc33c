"""Collectives by point-to-point exchange on gloo: results, isolation, policy, wrappers."""

from __future__ import annotations

import pytest
import torch

from cadence import CollectiveAlgorithms
from cadence._exchange import ExchangeWork
from cadence.errors import CadenceValueError
from cadence.testing import run_distributed
from tests.foundation import bodies_exchange


@pytest.mark.parametrize("world", [2, 4])
def test_exchange_matches_rank_order_sum_and_native(world: int) -> None:
    results = run_distributed(bodies_exchange.collectives, world_size=world, timeout=90)
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
        # Small units on two ranks: exchanged reduce-scatters, gloo's own all-gathers.
        assert r["fsdp_auto_used"] == ["all_gather:native", "reduce_scatter:exchange"]
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

    work = ExchangeWork(lambda: [FailingWork()], never, pg=object())
    with pytest.raises(RuntimeError, match="peer went away"):
        work.wait()
    assert work.is_completed()
    with pytest.raises(RuntimeError, match="peer went away"):  # every wait() says so
        work.wait()


def test_a_failed_post_is_raised_by_wait() -> None:
    def post() -> list[object]:
        raise RuntimeError("connection reset")

    work = ExchangeWork(post, pg=object())
    with pytest.raises(RuntimeError, match="connection reset"):
        work.wait()
    assert work.is_completed()


def test_a_forked_child_starts_its_own_threads() -> None:
    import multiprocessing as mp

    from cadence import _exchange

    key = object()
    parent = _exchange._group_threads(key)
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()

    def child() -> None:
        work = ExchangeWork(list, lambda: None, pg=key)
        work.wait()  # served by threads of this process, not the parent's dead ones
        queue.put(_exchange._group_threads(key) is not parent)

    proc = ctx.Process(target=child)
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0 and queue.get() is True


def test_policy_is_validated_and_scoped_to_gloo_cpu() -> None:
    with pytest.raises(CadenceValueError, match=r"reduce_scatter='ring'.*auto, native, exchange"):
        CollectiveAlgorithms(reduce_scatter="ring")  # type: ignore[arg-type]
    auto = CollectiveAlgorithms()
    cpu = torch.zeros(4)
    assert auto.uses_exchange("reduce_scatter", "gloo", cpu, 2)
    assert auto.uses_exchange("all_gather", "gloo", cpu, 4)
    assert not auto.uses_exchange("all_gather", "gloo", cpu, 2)  # small, two ranks: gloo's
    assert auto.uses_exchange("all_gather", "gloo", torch.zeros(1 << 18), 2)  # 1 MiB
    assert not auto.uses_exchange("all_reduce", "gloo", cpu, 2)  # opt-in only
    assert not auto.uses_exchange("reduce_scatter", "nccl", cpu, 2)
    assert not auto.uses_exchange("reduce_scatter", "gloo", cpu, 1)
    assert not CollectiveAlgorithms.native().uses_exchange("all_gather", "gloo", cpu, 2)
    meta = torch.empty(4, device="meta")
    assert not CollectiveAlgorithms("exchange", "exchange", "exchange").uses_exchange(
        "all_reduce", "gloo", meta, 2
    )
