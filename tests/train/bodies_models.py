"""Rank bodies of the ``--model`` tests: the embedded Llama and a transformers Llama
under several layouts, in one launch each."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from cadence.models.config import GPTConfig
from cadence.testing import run_subtests
from cadence.train.config import TrainConfig
from tests.train.bodies_train import run

LLAMA = TrainConfig(
    steps=3,
    batch_size=16,
    model=GPTConfig(seq_len=16),
    model_factory="llama",
    model_config={"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2},
)
HF_CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
HF = dataclasses.replace(
    LLAMA, steps=2, model_factory="hf:LlamaForCausalLM", model_config=HF_CONFIG
)


def body_models(base: TrainConfig, flag_sets: list[dict]) -> dict:
    """Every flag set over ``base`` in one launch; ``nproc`` follows the launched world."""
    world = dist.get_world_size()

    def case(flags: dict) -> dict:
        return run(dataclasses.replace(base, nproc=world, **flags))

    return run_subtests({"flags": flag_sets}, case)
