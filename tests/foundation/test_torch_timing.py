"""`cadence.gradient_timing`: the shared timing verbs drive torch's DDP and FSDP2 (torch 2.13)."""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.foundation.bodies_torch_timing import torch_timing_body


@pytest.fixture(scope="module")
def r() -> dict[str, Any]:
    return run_distributed(torch_timing_body, world_size=2, timeout=120)[0]


def test_fsdp2_driven_by_the_verbs(r: dict[str, Any]) -> None:
    f = r["fsdp2"]
    assert f["is_timing"]
    # The flag set after forward still governs the backward: 4 units reduce on the
    # last microbatch only, and training matches single-process training.
    assert f["rs_per_micro"] == [0, 4, 0, 4], f
    assert f["parity"] < 1e-5, f


def test_deferred_reduction_refused_on_torch_2_13(r: dict[str, Any]) -> None:
    assert r["fsdp2"]["deferred"] == "ok", r["fsdp2"]["deferred"]
    assert r["fsdp2"]["deferred_step"] == "ok", r["fsdp2"]["deferred_step"]


def test_ddp_driven_by_the_verbs(r: dict[str, Any]) -> None:
    d = r["ddp"]
    assert d["ours_is_itself"]
    assert d["ddp_all_reduces"] == 1, d  # one bucket, synced on the last microbatch only
    assert d["parity"] < 1e-6, d  # the same gradients as cadence.DataParallel
    assert d["off_after_forward_all_reduces"] == 0, d
    assert d["on_after_forward_all_reduces"] == 1, d
    assert d["no_sync_all_reduces"] == 0 and d["flag_restored"] is True, d
    assert d["flip_after_forward"] == "ok", d["flip_after_forward"]


def test_split_backward_refused_for_torch_wrappers(r: dict[str, Any]) -> None:
    d = r["ddp"]
    assert d["split"] == "ok", d["split"]
    theirs, ours = d["split_refusal"]
    assert "torch wrapper" in theirs and "cadence.DataParallel" in theirs, theirs
    assert ours is None
