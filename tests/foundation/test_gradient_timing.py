"""The timing verbs of `cadence.GradientTiming` mean the same on every wrapper.

One world-3 launch runs the same body for DataParallel and for fully_shard; each
test below asserts one verb for both. See [Note: one set of timing verbs] and
[Note: finalize inside backward] in ``cadence/_grad_timing/timing.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

import cadence
from tests.foundation.bodies_timing import WRAPPERS

Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def results(world3: list[dict[str, Any]]) -> Results:
    return {w: [r["timing"][f"wrapper={w!r}"] for r in world3] for w in WRAPPERS}


def test_gradient_timing_is_exported() -> None:
    assert cadence.GradientTiming.__module__ == "cadence._grad_timing.timing"
    assert "GradientTiming" in cadence.__all__


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_both_wrappers_implement_the_protocol(results: Results, wrapper: str) -> None:
    assert all(r["is_gradient_timing"] for r in results[wrapper])


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_only_the_sharded_wrapper_offers_unshard_and_reshard(
    results: Results, wrapper: str
) -> None:
    # The pipeline places UNSHARD/RESHARD on ShardedTiming units only.
    assert all(r["is_sharded_timing"] == (wrapper != "dp") for r in results[wrapper])


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("mode", ["auto", "manual"])
def test_finalize_and_step_inside_backward_once_every_reduction_launched(
    results: Results, wrapper: str, mode: str
) -> None:
    for rank, all_cases in enumerate(results[wrapper]):
        r = all_cases[f"in_backward_{mode}"]
        n = r["expected_reductions"]
        # Every reduction was issued by backward before the hook, and waited before
        # the step inside it; the step came before backward returned.
        assert r["issued_before_hook"] == r["reductions"] == n, (rank, r)
        assert r["waited_before_step"] and r["step_before_backward_end"], (rank, r)
        assert r["finalize_returned"] == "None"
        # The stepped parameters equal one SGD step on the concatenated batch.
        assert r["param_diff"] < 1e-6, (rank, r)
        # Nothing was left pending: a later finalize issues no collective.
        assert r["finalize_after"] == "None" and r["reductions_after"] == n, (rank, r)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_finalize_inside_backward_before_every_reduction_launched_raises(
    results: Results, wrapper: str
) -> None:
    unit = "buckets" if wrapper == "dp" else "units"
    for r in results[wrapper]:
        case = r["too_early"]
        (msg,) = case["messages"]
        assert msg.startswith("RuntimeError: finalize_backward() was called inside backward")
        assert f"of {case['expected']} {unit} have launched" in msg, msg
        # The refusal issued nothing; the finalize after backward adds nothing either.
        assert case["reductions"] == [case["expected"]] * 2


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_finalize_with_nothing_pending(results: Results, wrapper: str) -> None:
    r = results[wrapper][0]["nothing_pending"]
    assert r["blocking"] == "None"
    assert r["async_type"] == "ReductionHandle" and r["async_done"]
    assert r["collectives"] == 0


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_setters_inside_backward_raise(results: Results, wrapper: str) -> None:
    r = results[wrapper][0]["setters"]
    for verb in ("set_requires_gradient_sync", "set_manual_backward_finalization"):
        key = "sync" if verb == "set_requires_gradient_sync" else "manual"
        assert r[key].startswith(f"RuntimeError: {verb}() was called inside backward"), r[key]
    # Refused means unchanged: that backward still synced, automatically.
    assert r["manual_after"] == "False"
    assert int(r["reductions"]) > 0


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_sync_flag_recurse_and_should_finalize(results: Results, wrapper: str) -> None:
    r = results[wrapper][0]["flags"]
    assert r["should_manual_sync"] is True
    assert r["should_manual_nosync"] is False
    assert r["should_auto"] is False
    # recurse=True turned every unit off; the owed reduction is paid once by finalize.
    assert r["nosync_reductions"] == 0
    assert r["deferred_reductions"] == r["expected"]


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_optimizer_guard_and_reset_iter_state(results: Results, wrapper: str) -> None:
    r = results[wrapper][0]["guard"]
    assert "finaliz" in r["step_unfinalized"] and r["step_unfinalized"].startswith("RuntimeError")
    assert "handle.wait()" in r["step_unwaited"]
    assert r["backward_raised"] == "boom"
    for key in ("step_after_failure", "forward_after_failure"):
        assert r[key].startswith("RuntimeError"), r[key]
        assert "did not finish" in r[key] and "reset_iter_state()" in r[key], r[key]
    assert r["reductions_after_reset"] == r["expected"]
