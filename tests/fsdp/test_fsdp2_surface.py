"""cadence.fully_shard takes torch FSDP2's arguments, policies and setters.

Specification:
- ``mesh=`` (FSDP2's spelling) trains like torch FSDP2 on the same mesh, with the
  same numbers of all-gathers and reduce-scatters.
- torch's ``MixedPrecisionPolicy`` gives exactly what cadence's policy gives, and what
  FSDP2 gives with the same policy, with bf16 all-gathers and fp32 reduce-scatters.
- Each argument cadence cannot honour is refused with a cadence error that names the
  argument and, where there is one, the fix (`REFUSED`); ``set_requires_all_reduce``
  inside backward is refused too.
- ``OffloadPolicy()``, ``Shard(0)`` placements and ``ignored_params`` are accepted: an
  ignored parameter stays a plain tensor whose gradient is not reduced;
  ``reshard_after_forward=False`` on the units saves the backward's re-gathers.
- ``set_is_last_backward(False)`` keeps every microbatch's reductions in flight: ``.grad``
  stays pending and the optimizer step is refused until the last backward, and the
  parameters then match the plain loop.
"""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing import run_distributed
from tests._outcome import assert_refused
from tests.fsdp.bodies_fsdp2_surface import fsdp2_surface


@pytest.fixture(scope="module")
def surface() -> list[dict[str, Any]]:
    return run_distributed(fsdp2_surface, world_size=2, timeout=240)


def test_mesh_matches_fsdp2(surface: list[dict[str, Any]]) -> None:
    r = surface[0]["mesh"]
    assert r["cadence_parity"] < 1e-5 and r["fsdp2_parity"] < 1e-5, r
    assert tuple(r["cadence_counts"]) == tuple(r["fsdp2_counts"]), r


def test_torch_mixed_precision_policy(surface: list[dict[str, Any]]) -> None:
    r = surface[0]["torch_mp"]
    assert r["torch_vs_cadence_policy"] == 0.0, r  # converted field by field
    assert r["torch_policy_vs_fsdp2"] < 1e-6, r  # the same policy on both sides
    assert r["wire"] == ["all_gather:bfloat16", "reduce_scatter:float32"], r


# What each refusal's message must name: the argument, and the fix where there is one.
REFUSED = {
    "mesh_and_group": ["mesh= and group="],
    "mesh_type": ["DeviceMesh"],
    "cpu_offload": ["CPUOffloadPolicy", "drop offload_policy"],
    "raf_int": ["reshard_after_forward=2"],
    "placement_dim1": ["gave S(1)", "Return None or Shard(0)"],
    "dp_mesh_dims": ["dp_mesh_dims"],
    "bad_mp": ["mp_policy=str"],
    "other_offload": ["OffloadPolicy()"],
    "all_reduce_in_backward": ["inside backward"],
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_arguments(surface: list[dict[str, Any]], case: str) -> None:
    assert_refused(surface[0]["arguments"][case], *REFUSED[case])


def test_accepted_arguments(surface: list[dict[str, Any]]) -> None:
    r = surface[0]["arguments"]
    assert r["no_offload_ok"] == 1.0 and r["placement_dim0_ok"] == 1.0, r
    assert r["ignored_is_plain"] == 1.0 and r["ignored_others_sharded"] == 1.0, r
    assert r["ignored_grad_spread"] > 0, r  # an ignored parameter's grad is not reduced
    # Three units + root: forward gathers 4; backward re-gathers the 3 resharded units.
    assert (r["ag_raf_true"], r["ag_raf_false"]) == (7, 4), r


def test_set_is_last_backward(surface: list[dict[str, Any]]) -> None:
    r = surface[0]["is_last_backward"]
    assert r["rs_per_micro"] == [4, 4, 4, 4], r  # every microbatch reduces
    assert r["grad_early"] == "PendingGrad", r  # ... but .grad waits for the last one
    assert_refused(r["step_early"], "finalize_backward()")
    assert r["parity"] < 1e-5, r
