"""``cadence train --model``: the user's own model, the embedded Llama, transformers.

Specification:
- a ``--model`` that cannot be built is refused in one line, status 2, before any rank
  starts, naming the fix: a module that does not import, an attribute it lacks, one
  that is not callable, a factory that returns no ``nn.Module``, keyword arguments the
  factory refuses, a spec of another shape; so is ``--model-config`` that is not a
  JSON object or comes without ``--model``, a TinyGPT flag with ``--model``, a model
  without the block protocol under ``--fsdp``, ``--pp`` or ``--ac`` (naming the attribute), a
  transformers model in a pipeline, and logits narrower than the data's vocabulary;
- a model without the protocol trains under DataParallel (finite losses that move);
- ``--model llama`` trains 3 steps under DataParallel and fully_shard (world 2), and
  pp 2 x dp 2 (world 4); its losses fall, and each layout's match DataParallel's to
  1e-5 relative (the same global batches from the same initial model);
- ``--model hf:LlamaForCausalLM`` trains 2 steps under DataParallel and fully_shard
  (one unit per decoder layer), alike to 1e-5, and a resumed run logs the unbroken
  run's losses bit for bit;
- ``model_factory`` and ``model_config`` read back from ``config.toml``;
- every command of docs/train.md's "Your model" passes every check before the launch
  (its layouts train in the tests above).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
from pathlib import Path

import pytest

import cadence.train.run as run_module
from cadence.cli import main
from cadence.testing import run_distributed
from cadence.train.config import TrainConfig
from cadence.train.config_file import read_config_file
from cadence.train.report import write_config
from tests.train.bodies_models import HF, HF_CONFIG, LLAMA, body_models

pytestmark = pytest.mark.one_lane  # [Note: one lane runs each end-to-end run of cadence train]

U = "tests.train.user_models"
BASE = ["train", "--nproc", "2", "--batch-size", "8", "--steps", "2"]
HF_JSON = json.dumps(HF_CONFIG)

# (extra argv, what the one line must name)
REFUSED: list[tuple[list[str], tuple[str, ...]]] = [
    (["--model", "no_such_pkg.models:build"], ("no module named 'no_such_pkg'",)),
    (["--model", f"{U}:missing"], ("has no attribute 'missing'",)),
    (["--model", f"{U}:NOT_CALLABLE"], ("NOT_CALLABLE is a int, not callable",)),
    (["--model", f"{U}:not_a_module"], ("returned a dict, not a torch nn.Module",)),
    (
        ["--model", f"{U}:plain", "--model-config", '{"width": 3}'],
        ("failed when called with width", "unexpected keyword argument 'width'"),
    ),
    (["--model", "llama", "--model-config", '{"n_kv_heads": 3}'], ("n_kv_heads 3",)),
    (["--model", "gpt2"], ("--model 'gpt2' must be llama, hf:<ClassName>",)),
    (["--model", "hf:NoSuchForCausalLM"], ("has no model class of that name",)),
    (["--model-config", '{"dim": 8}'], ("--model-config", "add --model")),
    (["--model", "llama", "--model-config", "[1]"], ("--model-config", "JSON object")),
    (["--model", "llama", "--model-config", '{"dim": null}'], ("'dim'", "null")),
    (["--model", "llama", "--d-model", "32"], ("--d-model", "--model-config")),
    (["--model", f"{U}:plain", "--fsdp"], ("--fsdp", "cadence_blocks")),
    (["--model", f"{U}:plain", "--pp", "2"], ("--pp", "split_stages", "cadence_stage_parts")),
    (
        ["--model", f"{U}:plain", "--ac", "full"],
        ("--ac full", "declares no blocks", "cadence_blocks"),
    ),
    (
        ["--model", "llama", "--pp", "2", "--model-config", '{"tie_embeddings": true}'],
        ("tied embeddings",),
    ),
    (["--model", "hf:LlamaForCausalLM", "--pp", "2"], ("pipelines are not offered",)),
    (["--model", f"{U}:narrow"], ("logits cover 8 token ids", "the data has 64")),
    (["--model", f"{U}:plain", "--compile"], ("--compile", "TinyGPT, --model llama")),
]


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(cfg: object) -> None:
        raise AssertionError(f"validation let this reach the launch: {cfg}")

    monkeypatch.setattr(run_module, "train", refuse)


@pytest.mark.parametrize(("argv", "names"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_model_that_cannot_train_is_refused_in_one_line(
    argv: list[str], names: tuple[str, ...], capsys, no_launch
) -> None:
    if "hf:" in " ".join(argv):
        pytest.importorskip("transformers")
    rc = main([*BASE, *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0], err
    for name in names:
        assert name in lines[0], lines[0]


def test_the_model_options_read_back(tmp_path: Path) -> None:
    for cfg in (
        LLAMA,
        HF,
        TrainConfig(model_factory=f"{U}:plain", model_config={"d": [1, 2.5], "x y": {"a": "é"}}),
    ):
        path = write_config(cfg, tmp_path)
        assert TrainConfig(**read_config_file(path)) == cfg
    assert "[train.model_config]" not in write_config(TrainConfig(), tmp_path).read_text()


def test_a_model_without_the_protocol_trains_under_data_parallel(tmp_path: Path) -> None:
    run = tmp_path / "run"
    argv = [*BASE, "--model", f"{U}:plain", "--model-config", '{"dim": 8}', "--run-dir", str(run)]
    assert main(argv) == 0
    losses = json.loads((run / "metrics.json").read_text())["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and losses[1] != losses[0]


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _rank0(results: list[dict]) -> list[dict]:
    for res in results[1:]:
        for label, r in res.items():
            assert r["losses"] == results[0][label]["losses"], label
    return list(results[0].values())


def test_llama_trains_under_dp_and_fsdp() -> None:
    dp, fsdp = _rank0(run_distributed(body_models, LLAMA, [{}, {"fsdp": True}], timeout=150))
    assert dp["modules"] == ["DataParallel"] and fsdp["wrapper"] == "fully_shard"
    assert fsdp["units"] == 4 + 1  # a unit per layer, and the root
    assert dp["losses"][-1] < dp["losses"][0]
    assert _close(fsdp["losses"], dp["losses"]) < 1e-5, (fsdp, dp)


@pytest.mark.slow
def test_llama_trains_in_a_pipeline() -> None:
    dp4, pp2 = _rank0(
        run_distributed(body_models, LLAMA, [{}, {"pp": 2}], world_size=4, timeout=240)
    )
    assert pp2["wrapper"] == "DataParallel" and pp2["modules"] == ["DataParallel"]
    assert dp4["losses"][-1] < dp4["losses"][0]
    assert _close(pp2["losses"], dp4["losses"]) < 1e-5, (pp2, dp4)


def test_a_transformers_llama_trains_under_dp_and_fsdp() -> None:
    pytest.importorskip("transformers")
    dp, fsdp = _rank0(run_distributed(body_models, HF, [{}, {"fsdp": True}], timeout=150))
    assert dp["modules"] == ["DataParallel"] and fsdp["units"] == 2 + 1
    assert all(math.isfinite(x) for x in dp["losses"]) and len(dp["losses"]) == 2
    assert _close(fsdp["losses"], dp["losses"]) < 1e-5, (fsdp, dp)


def test_a_transformers_llama_resumes_bit_exact(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    run = tmp_path / "run"
    flags = [
        *BASE[:-1],
        "4",
        "--model",
        "hf:LlamaForCausalLM",
        "--model-config",
        HF_JSON,
        "--fsdp",
        "--checkpoint-every",
        "2",
        "--run-dir",
        str(run),
    ]
    assert main(flags) == 0
    whole = json.loads((run / "metrics.json").read_text())["losses"]
    # lose the last checkpoint: the resumed run trains steps 3 and 4 again from step-2
    shutil.rmtree(run / "checkpoints" / "step-4")
    assert main([*flags, "--resume"]) == 0
    assert json.loads((run / "metrics.json").read_text())["losses"] == whole
    saved = read_config_file(run / "config.toml")
    assert saved["model_factory"] == "hf:LlamaForCausalLM" and saved["model_config"] == HF_CONFIG


def _documented_commands() -> list[list[str]]:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "train.md").read_text()
    section = doc.split("## Your model", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    lines = [ln.split("  #")[0] for ln in block[1].splitlines() if ln.strip()]
    return [shlex.split(ln)[1:] for ln in lines]


def test_the_documented_commands_pass_every_check(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    seen: list[TrainConfig] = []
    monkeypatch.setattr(run_module, "train", seen.append)
    commands = _documented_commands()
    assert len(commands) == 5
    for argv in commands:
        assert main(argv) == 0, argv
    assert [c.model_factory for c in seen] == [
        "llama",
        "llama",
        "llama",
        "hf:LlamaForCausalLM",
        f"{U}:plain",
    ]
    assert seen[2].layout().pp == 2 and seen[3].fsdp
