"""``torch.save(model.state_dict())`` round-trips exactly on every rank (and the optimizer).

Specification, on every rank, at world 2 (fp32 and mixed precision) and 3 (fp32):
- each rank's ``torch.save`` of the model and optimizer state dicts, loaded into a
  differently initialised model and a fresh optimizer, gives exactly the saved values,
  with tied weights still tied, and training on gives exactly the same parameters (the
  optimizer's momentum survived);
- ``torch.load``'s default (``weights_only=True``) reads the saved file, giving the same
  tensors as the full unpickler, as for torch's FSDP2;
- ``torch.distributed.checkpoint`` through its state_dict API (as in the docs) round-trips
  the optimizer and trains on identically, and a full state dict equals
  ``full_state_dict()``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.testing import run_distributed
from tests.fsdp.bodies_torch_save import torch_save_cases


@pytest.mark.parametrize("world", [2, 3])
def test_torch_save_round_trip(tmp_path: Path, world: int) -> None:
    # (mixed precision, with DCP): DCP is slow to start, so one case covers it.
    cases = [(False, True), (True, False)] if world == 2 else [(False, False)]
    results = run_distributed(torch_save_cases, str(tmp_path), cases, world_size=world, timeout=150)
    for rank, per_case in enumerate(results):
        for (mp, with_dcp), r in zip(cases, per_case):
            where = (rank, "mp" if mp else "fp32", r)
            assert r["differs_before_load"] > 0, where
            assert r["model_sd"] == 0.0 and r["optim_sd"] == 0.0, where
            assert r["after_training"] == 0.0, where  # the momentum survived
            assert r["tied"] == 1.0, where
            # torch.load's default (weights_only=True) reads the same tensors.
            assert r["weights_only_vs_full_load"] == 0.0, where
            if with_dcp:
                # torch.distributed.checkpoint through its state_dict API (as in the docs).
                assert r["dcp_optim_sd"] == 0.0 and r["dcp_after_training"] == 0.0, where
                assert r["full_sd"] == 0.0, where
