"""``split_backward("input" | "weight")``, the timing verb of both wrappers that
zero-bubble pipelines use, checked directly at world 2.

Specification: a backward run as an input part (input gradients only) and a later
weight part (``backward_input`` / ``run_weight``) gives the same input gradients,
the same reduced parameter gradients and the same reductions, in the same order,
as fused backwards, for `fully_shard` (nested units) and `DataParallel` (several
buckets). An unknown part, nested parts and a part entered inside a backward are
each refused with the fix.
"""

from __future__ import annotations

import pytest

from cadence.testing import run_distributed
from tests.pipeline.runtime.bodies_split_verbs import body


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(body, world_size=2, timeout=120)


def test_split_parts_equal_a_fused_backward(results) -> None:
    for res in results:
        for case, r in res["parity"].items():
            assert r["grad_diff"] <= 1e-6 and r["dx_diff"] <= 1e-6, (case, r)
            assert r["same_reductions"] and r["n_reductions"] >= 3, (case, r)


MISUSE = {
    "bad_part": "the part must be one of ('input', 'weight')",
    "nested": "inside split_backward('input'): the parts of a split backward run one after",
    "inside_backward": "split_backward('weight') was called inside backward",
}


@pytest.mark.parametrize("case", sorted(MISUSE))
def test_split_part_misuse(results, case: str) -> None:
    for res in results:
        for wrapper, msgs in res["misuse"].items():
            assert MISUSE[case] in msgs[case], (wrapper, msgs[case])
