"""Save, then load in a fresh process on a cold node: same outputs and gradients.

Both runs are fresh interpreters (`cadence.launch`, no process group), each with its own
empty inductor cache, as two machines would have. The step is compiled with inductor,
the real backend, after a first backward (so the parameters have ``.grad`` while
compiling), and two SGD steps follow in each process: the compiled step must see the
updated weights. The loading process builds no C++: every library it uses came with the
artifact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cadence
from cadence.testing import assert_close
from tests.precompiling._bodies import fresh_body

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _run(cache: Path, inductor: Path) -> dict:
    env = {"TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    (out,) = cadence.launch(
        fresh_body, str(cache), "inductor", nprocs=1, init_process_group=False, env=env
    )
    return out


def test_save_then_load_in_a_fresh_process(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    saved = _run(cache, tmp_path / "inductor-a")
    loaded = _run(cache, tmp_path / "inductor-b")
    assert saved["source"] == "compiled" and saved["stats"]["compiles"] == 1
    assert loaded["source"] == "cache" and loaded["stats"]["compiles"] == 0
    for run in (saved, loaded):
        for step in run["steps"]:  # compiled against eager, before and after an update
            assert_close(step["compiled"], step["eager"], atol=1e-5, msg=run["source"])
        assert_close(run["params"], run["eager_params"], atol=1e-5)
    # The loaded artifact computes exactly what the compiled one did.
    for a, b in zip(saved["steps"], loaded["steps"]):
        assert_close(a["compiled"], b["compiled"], atol=0.0)
    first, second = (s["compiled"]["loss"] for s in saved["steps"])
    assert not torch.equal(first, second)  # the update was seen
    # Cold node: the shipped libraries are all it has, and it built none of its own.
    assert loaded["timings"]["kernels_written"] == len(loaded["libraries"]) > 0
    assert set(loaded["libraries"]) <= set(saved["libraries"])
