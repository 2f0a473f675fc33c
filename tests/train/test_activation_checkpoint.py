"""``cadence train --ac``: activation checkpointing changes what is kept, not a number.

Specification:
- ``--ac full`` and ``--ac selective`` train TinyGPT to the losses and the final
  parameters of the run without ``--ac``, bit for bit (``==`` and ``torch.equal``: the
  recompute runs the same operators on the same inputs, deterministic on CPU), under
  DataParallel (world 2), fully_shard (world 2), pipelines (pp 2: 1F1B, and
  interleaved with two stages per rank) and, marked slow, a pipeline of fully_shard
  stages (pp 2 x dp 2, world 4); every block of the model is checkpointed, on each
  rank that holds it;
- the same for the blocks the block protocol declares in other models: ``--model
  llama`` under fully_shard, a ``transformers`` LlamaForCausalLM (``hf:``) under
  DataParallel;
- a run with ``--ac`` (or without), lost and resumed with ``--ac``, logs the unbroken
  run's losses bit for bit (checkpoints do not depend on ``--ac``);
- checkpointing keeps each block's class and parameter names: the state dict's keys
  are those of the model without ``--ac`` and a state dict of either loads into the
  other; a deep copy checkpoints its own blocks; a block is checkpointed once; without
  gradients (evaluation, sampling) a block runs its plain forward;
- what each mode keeps, on one forward and backward of TinyGPT (counted, not timed,
  no peak memory): the bytes the forward leaves alive for backward fall from none to
  selective to full; the backward of selective runs no matmul or attention kernel
  beyond the plain backward's (their outputs were kept), full's runs more (it
  recomputes them);
- ``--ac`` is accepted with every schedule without a split backward (gpipe, 1f1b,
  interleaved, looped_bfs) and is a ``[train]`` key that reads back from config.toml;
  the refusals (split-backward schedules, ``--compile``, a model without blocks) are
  in tests/train/test_config.py, test_refused_inputs.py and test_model_flag.py;
  `checkpoint_blocks` refuses a model without blocks on the rank too.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cadence.models.config import GPTConfig
from cadence.models.gpt import Block, TinyGPT
from cadence.testing import run_distributed
from cadence.train._errors import TrainConfigError
from cadence.train.activation_checkpoint import (
    AC_ATTR,
    SAVED_OPS,
    checkpoint_blocks,
    checkpoint_module,
)
from cadence.train.config import TrainConfig
from cadence.train.config_file import read_config_file
from cadence.train.report import write_config
from tests.train.bodies_activation_checkpoint import BASE, body_ac, body_resume
from tests.train.bodies_models import HF, LLAMA
from tests.train.user_models import Plain

pytestmark = pytest.mark.one_lane  # [Note: one lane runs each end-to-end run of cadence train]

# -- the same numbers, every layout --------------------------------------------


def _check_equal(results: list[list[dict[str, Any]]], blocks: int, replicas: int) -> None:
    """Every rank's full and selective runs equal its run without --ac, bit for bit;
    ``blocks`` blocks, each held by ``replicas`` ranks, were checkpointed."""
    for flag_set in zip(*results, strict=True):  # one flag set, every rank
        for mode in ("full", "selective"):
            held = 0
            for rank_runs in flag_set:
                plain, run = rank_runs["none"], rank_runs[mode]
                assert run["losses"] == plain["losses"], mode
                assert run["params"].keys() == plain["params"].keys(), mode
                for name, value in run["params"].items():
                    assert torch.equal(value, plain["params"][name]), (mode, name)
                assert plain["checkpointed"] == []
                assert set(run["checkpointed"]) <= {mode}
                held += len(run["checkpointed"])
            assert held == blocks * replicas, (mode, held)
        losses = flag_set[0]["none"]["losses"]
        assert len(losses) == 3 and losses[-1] != losses[0]  # it trained


@pytest.mark.parametrize(
    ("flag_sets", "replicas"),
    [([{}], 2), ([{"fsdp": True}], 2), ([{"pp": 2}, {"pp": 2, "schedule": "interleaved"}], 1)],
    ids=["dp2", "fsdp2", "pp2-1f1b-interleaved"],
)
def test_ac_trains_bitwise_like_no_ac(flag_sets: list[dict[str, Any]], replicas: int) -> None:
    results = run_distributed(body_ac, BASE, flag_sets, world_size=2, timeout=240)
    _check_equal(results, BASE.model.n_layers, replicas)


@pytest.mark.slow
def test_ac_in_a_pipeline_of_sharded_stages() -> None:
    results = run_distributed(body_ac, BASE, [{"pp": 2, "fsdp": True}], world_size=4, timeout=400)
    _check_equal(results, BASE.model.n_layers, 2)  # pp 2 x dp 2: two ranks per block


def test_the_embedded_llama_under_fsdp() -> None:
    results = run_distributed(body_ac, LLAMA, [{"fsdp": True}], world_size=2, timeout=240)
    _check_equal(results, LLAMA.model_config["n_layers"], 2)


def test_a_transformers_llama_under_data_parallel() -> None:
    pytest.importorskip("transformers")
    # 3 steps: the check wants a loss that moves; HF's own runs take 2.
    cfg = dataclasses.replace(HF, steps=3)
    results = run_distributed(body_ac, cfg, [{}], world_size=2, timeout=240)
    _check_equal(results, cfg.model_config["num_hidden_layers"], 2)


@pytest.mark.parametrize(
    ("flags", "before", "after"),
    [({"fsdp": True}, "none", "full"), ({}, "selective", "selective")],
    ids=["fsdp-none-then-full", "dp-selective"],
)
def test_resume_with_ac_is_bit_identical(
    tmp_path: Path, flags: dict[str, Any], before: str, after: str
) -> None:
    results = run_distributed(body_resume, flags, str(tmp_path), before, after, timeout=240)
    for r in results:
        assert r["resumed"] == r["full"] and len(r["full"]) == 6
        assert r["history"].resumes == [3]


# -- the model as it was ---------------------------------------------------------


def _gpt(ac: str = "none", n_layers: int = 2) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(d_model=32, n_layers=n_layers))
    if ac != "none":
        checkpoint_blocks(model, ac)
    return model


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_blocks_keep_their_class_and_parameter_names(ac: str) -> None:
    plain, checkpointed = _gpt(), _gpt(ac)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert [type(b) for b in checkpointed.blocks] == [Block, Block]
    assert all(getattr(b, AC_ATTR) == ac for b in checkpointed.blocks)
    # Each loads the other's state dict (strict), value for value.
    trained = _gpt()
    for p in trained.parameters():
        p.data.add_(1.0)
    checkpointed.load_state_dict(trained.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(checkpointed.parameters(), trained.parameters()))
    plain.load_state_dict(checkpointed.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), trained.parameters()))


def test_a_copy_checkpoints_its_own_blocks_and_a_block_is_checkpointed_once() -> None:
    model = _gpt("full")
    twin = copy.deepcopy(model)
    for block, original in zip(twin.blocks, model.blocks):
        assert block.forward.__self__ is block and block is not original
    with pytest.raises(ValueError, match="already replaced on this instance"):
        checkpoint_module(model.blocks[0], "selective")
    with pytest.raises(ValueError, match="full or selective"):
        checkpoint_module(_gpt().blocks[0], "none")


def test_without_gradients_a_block_runs_its_plain_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cadence.train.activation_checkpoint as ac_module

    calls: list[int] = []
    real = ac_module.checkpoint

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ac_module, "checkpoint", counting)
    model, x = _gpt("full"), torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        model(x)
    assert calls == []
    model(x)
    assert len(calls) == 2  # one per block


def test_a_model_without_blocks_is_refused_on_the_rank() -> None:
    with pytest.raises(TrainConfigError, match=r"--ac full checkpoints each block.*Plain"):
        checkpoint_blocks(Plain(), "full")


# -- what each mode keeps (counted, not timed) ------------------------------------


class _Alive(TorchDispatchMode):
    """Remembers the storage of every tensor an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.storages[s._cdata] = (StorageWeakRef(s), s.nbytes())
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        return sum(
            n for key, (ref, n) in self.storages.items() if key not in exclude and not ref.expired()
        )


class _Kernels(TorchDispatchMode):
    """Counts the matmul and attention kernels (`SAVED_OPS`) that run."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in SAVED_OPS:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _kept_and_rerun(ac: str) -> tuple[int, int]:
    """TinyGPT (4 blocks): the bytes its forward leaves alive for backward (beyond
    the parameters and the logits), and the matmul/attention kernels its backward runs."""
    model, x = _gpt(ac, n_layers=4), torch.randint(0, 64, (4, 32))
    with _Alive() as alive:
        logits = model(x)
    exclude = {p.untyped_storage()._cdata for p in model.parameters()}
    exclude.add(logits.untyped_storage()._cdata)
    kept = alive.alive_bytes(exclude)
    loss = TinyGPT.loss(logits, x)
    with _Kernels() as kernels:
        loss.backward()
    return kept, sum(kernels.counts.values())


def test_full_keeps_least_and_selective_reruns_no_matmul() -> None:
    (none_kept, none_run), (full_kept, full_run), (sel_kept, sel_run) = (
        _kept_and_rerun(ac) for ac in ("none", "full", "selective")
    )
    print(f"bytes kept for backward: none {none_kept}, selective {sel_kept}, full {full_kept}")
    assert none_kept > sel_kept > full_kept > 0
    assert sel_run == none_run  # matmul and attention outputs were kept, not recomputed
    assert full_run > none_run  # full recomputes them before their gradients


# -- accepted, and written down ----------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "looped_bfs"])
def test_schedules_without_a_split_backward_take_ac(schedule: str) -> None:
    for ac in ("full", "selective"):
        assert TrainConfig(ac=ac, pp=2, schedule=schedule).layout(2).schedule == schedule


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_ac_reads_back_from_config_toml(tmp_path: Path, ac: str) -> None:
    cfg = TrainConfig(ac=ac, fsdp=True)
    path = write_config(cfg, tmp_path)
    assert TrainConfig(**read_config_file(path)) == cfg
