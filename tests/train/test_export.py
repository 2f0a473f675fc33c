"""``cadence train --export DIR``: weights a user takes away.

Specification:
- every layout (DataParallel, fully_shard, a pipeline; at world 4 HSDP and a pipeline
  of fully_shard stages) writes one ``model.safetensors`` whose names are the unwrapped
  model's ``state_dict`` names (the tied head once), and every rank finds each tensor it
  trained (gathered, if sharded) in it bit for bit (`bodies_export`);
- the layouts' exports agree with each other (the same global batches from the same
  initial model), so the file does not depend on how the run was laid out;
- a ``transformers`` model's export is its ``from_pretrained`` folder: loaded in a
  process where cadence cannot be imported, its logits equal the exported weights'
  logits computed here;
- the CLI flag writes the file at the end of a run, and a bad path is refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from cadence.testing import run_distributed
from tests.train.bodies_export import BASE, body_export

pytestmark = pytest.mark.one_lane  # [Note: one lane runs each end-to-end run of cadence train]

LAYOUTS_2 = {"dp": {}, "fsdp": {"fsdp": True}, "pp2": {"pp": 2}}
LAYOUTS_4 = {"pp2xfsdp2": {"pp": 2, "fsdp": True}, "hsdp2x2": {"fsdp": True, "dp_replicate": 2}}


def _export(flags: dict[str, Any], tmp: Path, world: int) -> dict[str, torch.Tensor]:
    results = run_distributed(body_export, flags, str(tmp), world_size=world, timeout=150)
    saved = results[0]
    assert saved is not None
    return saved


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    return {k: _export(f, tmp_path_factory.mktemp(k), 2) for k, f in LAYOUTS_2.items()}


def _agree(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """Equal to a tenth of the learning rate: the layouts sum gradients in other orders,
    and AdamW's first steps move a parameter whose gradient is nearly zero by up to the
    learning rate either way, so a rounding difference there shows at that scale."""
    assert sorted(got) == sorted(want), what
    tol = 0.1 * BASE.lr
    for name in want:
        diff = (got[name] - want[name]).abs().max().item()
        assert diff < tol, f"{what}: '{name}' differs by {diff:.3e} (tolerance {tol:.1e})"


def test_names_are_the_unwrapped_models(world2: dict[str, dict[str, torch.Tensor]]) -> None:
    from cadence.models.gpt import TinyGPT

    model = TinyGPT(BASE.model)
    want = {n for n, _ in model.named_parameters()} | set(
        dict(model.named_buffers(remove_duplicate=True))
    )
    want &= set(model.state_dict())
    assert set(world2["dp"]) == want


@pytest.mark.parametrize("layout", ["fsdp", "pp2"])
def test_layouts_export_the_same_weights(
    world2: dict[str, dict[str, torch.Tensor]], layout: str
) -> None:
    _agree(world2[layout], world2["dp"], f"{layout} vs dp")


@pytest.mark.slow
@pytest.mark.other_lane  # world 4: see [Note: costly launcher tests run on the other lane only]
@pytest.mark.parametrize("layout", list(LAYOUTS_4))
def test_world4_layouts_export_the_same_weights(
    world2: dict[str, dict[str, torch.Tensor]], layout: str, tmp_path: Path
) -> None:
    _agree(_export(LAYOUTS_4[layout], tmp_path, 4), world2["dp"], f"{layout} vs dp")


_LOAD_WITHOUT_CADENCE = """
import sys
sys.modules["cadence"] = None  # an import of cadence now fails: the folder must not need it
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = torch.arange(12).reshape(2, 6) % model.config.vocab_size
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[2])
"""


def test_a_transformers_export_loads_without_cadence(tmp_path: Path) -> None:
    """fully_shard over a transformers Llama (a unit per decoder layer): the folder is
    ``from_pretrained``'s, and its logits are the exported weights' logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from cadence.models.config import GPTConfig
    from tests.train.bodies_models import HF_CONFIG

    flags = {
        "fsdp": True,
        "model": GPTConfig(seq_len=16),  # the data's shape; the model's is HF_CONFIG
        "model_factory": "hf:LlamaForCausalLM",
        "model_config": HF_CONFIG,
    }
    saved = _export(flags, tmp_path, 2)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"], config
    out = tmp_path / "logits.pt"
    subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_CADENCE, str(tmp_path), str(out)],
        check=True,
        timeout=120,
    )
    here = LlamaForCausalLM(LlamaConfig.from_pretrained(tmp_path))
    missing, unexpected = here.load_state_dict(saved, strict=False)
    tied = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
    assert set(missing) <= tied and not unexpected, (missing, unexpected)
    ids = torch.arange(12).reshape(2, 6) % here.config.vocab_size
    with torch.no_grad():
        want = here(input_ids=ids).logits
    assert torch.equal(torch.load(out), want)


def test_the_flag_exports_at_the_end_of_a_run(tmp_path: Path) -> None:
    from cadence.cli import main

    code = main(
        [
            "train",
            "--nproc",
            "2",
            "--steps",
            "1",
            "--batch-size",
            "8",
            "--d-model",
            "16",
            "--layers",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            "--export",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not list((tmp_path / "out").glob(".*partial"))
