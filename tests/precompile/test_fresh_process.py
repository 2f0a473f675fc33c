"""Save, then load in a fresh process: identical outputs and gradients, live parameters.

Both runs are fresh interpreters (`cadence.launch`, no process group). The step is
compiled with inductor, the real backend, after a first backward (so the parameters have
``.grad`` while compiling), and two SGD steps follow in each process: the compiled step
must see the updated weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cadence
from cadence.testing import assert_close
from tests.precompile._bodies import fresh_body

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_save_then_load_in_a_fresh_process(tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    (saved,) = cadence.launch(fresh_body, cache, "inductor", nprocs=1, init_process_group=False)
    (loaded,) = cadence.launch(fresh_body, cache, "inductor", nprocs=1, init_process_group=False)
    assert saved["source"] == "compiled" and saved["stats"]["compiles"] == 1
    assert loaded["source"] == "cache" and loaded["stats"]["compiles"] == 0
    for run in (saved, loaded):
        for step in run["steps"]:  # compiled against eager, before and after an update
            assert_close(step["compiled"], step["eager"], atol=1e-5, msg=run["source"])
        assert_close(run["params"], run["eager_params"], atol=1e-5)
    # The loaded artifact computes exactly what the compiled one did.
    for a, b in zip(saved["steps"], loaded["steps"]):
        assert_close(a["compiled"], b["compiled"], atol=0.0)
    assert not torch.equal(
        saved["steps"][0]["compiled"]["loss"], saved["steps"][1]["compiled"]["loss"]
    )
