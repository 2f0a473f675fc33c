"""The CUDA (NCCL, streams and events) path; skipped where no GPU exists."""

from __future__ import annotations

import pytest
import torch

from cadence.testing import run_distributed
from tests.fsdp.bodies_world4 import cuda_body


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_streams_parity_world1() -> None:
    result = run_distributed(cuda_body, world_size=1, backend="nccl", timeout=120)[0]
    assert result["cuda_parity"] <= 1e-5
