"""``cadence train --model``: build the user's model, or refuse it in one line.

``--model`` names a factory (`TrainConfig.model_factory`), called with
``--model-config``'s keyword arguments:

- ``""`` (the default): the embedded `TinyGPT` of ``--d-model``, ``--layers``,
  ``[train.model]``;
- ``llama``: the embedded `cadence.models.llama.Llama`; its ``vocab_size`` and
  ``seq_len`` default to the data's (``--vocab-size``, ``[train.model] seq_len``);
- ``hf:<ClassName>``: a ``transformers`` model from its config (`cadence.models.hf`);
  its ``vocab_size`` defaults to the data's;
- ``package.module:factory``: ``factory(**model_config)`` from an importable module.

The model's contract: ``forward(ids)`` takes token ids (B, T) and returns logits
(B, T, V) with V at least the data's vocabulary (or an object whose ``.logits`` is
that tensor, as ``transformers`` models return); the loss is cross-entropy. Under
``--fsdp``, ``--pp`` and ``--ac`` it also declares the block protocol
(`cadence.models.protocol`).

`check_model` runs before any rank starts (from the CLI): it imports the factory and
builds the model on the meta device (no memory), so a factory that cannot be imported,
is not callable, refuses its keyword arguments or returns no ``nn.Module``, and a model
without the protocol its layout needs, is one line naming the fix. `build_model` is
what each rank calls.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cadence.errors import CadenceValueError
from cadence.models._errors import BlockProtocolError
from cadence.models.gpt import TinyGPT
from cadence.models.hf import HFCausalLM
from cadence.models.protocol import BLOCKS, PARTS, SPLIT, can_split, model_blocks, split_model
from cadence.train._errors import TrainConfigError
from cadence.train.config import TrainConfig

__all__ = ["build_model", "check_model", "factory_kwargs", "factory_of"]

LLAMA = "cadence.models.llama:Llama"


def factory_of(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` (a `TrainConfig.model_factory`) names, or a
    `TrainConfigError` saying why there is none."""
    if spec == "llama":
        spec = LLAMA
    if spec.startswith("hf:"):
        from cadence.models.hf import hf_causal_lm, hf_class

        name = spec[3:]
        try:
            hf_class(name)
        except CadenceValueError as exc:
            raise TrainConfigError(str(exc)) from None
        return lambda **kwargs: hf_causal_lm(name, **kwargs)
    module_name, _, attr = spec.partition(":")
    flag = f"--model {spec}"
    # The working folder is importable, as under ``python -m`` (the launched ranks'
    # way), so the check here and the ranks find the same module.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise TrainConfigError(
            f"{flag}: no module named {exc.name!r}; make {module_name} importable "
            "(install it, or run from the folder that holds it)"
        ) from None
    except Exception as exc:  # the user's module failed while importing
        raise TrainConfigError(
            f"{flag}: importing {module_name} failed: {type(exc).__name__}: {exc}"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TrainConfigError(
                f"{flag}: module {module_name} has no attribute {attr!r}; name a function "
                "or class in it that returns an nn.Module"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise TrainConfigError(
            f"{flag}: {attr} is a {type(obj).__name__}, not callable; name a function or "
            "class that returns an nn.Module"
        )
    return obj  # type: ignore[no-any-return]  # checked callable above


def factory_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """``--model-config``, with the data's shape for the embedded aliases."""
    kwargs = dict(cfg.model_config)
    if cfg.model_factory == "llama":
        kwargs.setdefault("vocab_size", cfg.model.vocab_size)
        kwargs.setdefault("seq_len", cfg.model.seq_len)
    elif cfg.model_factory.startswith("hf:"):
        kwargs.setdefault("vocab_size", cfg.model.vocab_size)
    return kwargs


def build_model(cfg: TrainConfig) -> nn.Module:
    """The model ``cfg`` trains, on the current default device (initialised from the
    current torch seed)."""
    if not cfg.model_factory:
        return TinyGPT(cfg.model)
    factory = factory_of(cfg.model_factory)
    kwargs = factory_kwargs(cfg)
    flag = f"--model {cfg.model_factory}"
    try:
        model = factory(**kwargs)
    except TrainConfigError:
        raise
    except Exception as exc:  # bad keyword arguments, or the factory's own refusal
        shown = ", ".join(sorted(kwargs)) or "no keyword arguments"
        raise TrainConfigError(
            f"{flag} failed when called with {shown}: {type(exc).__name__}: {exc}; fix "
            "--model-config ([train.model_config])"
        ) from exc
    if not isinstance(model, nn.Module):
        raise TrainConfigError(
            f"{flag} returned a {type(model).__name__}, not a torch nn.Module; return the model"
        )
    return model


def check_model(cfg: TrainConfig) -> None:
    """Refuse (`TrainConfigError`) a ``--model`` that cannot be built, or that lacks the
    block protocol ``cfg``'s layout needs; the model is built on the meta device."""
    if not cfg.model_factory:
        return
    with torch.device("meta"):
        model = build_model(cfg)
    layout = cfg.layout()
    flag = f"--model {cfg.model_factory}"
    try:
        blocks = model_blocks(model)
    except BlockProtocolError as exc:
        raise TrainConfigError(f"{flag}: {exc}") from None
    name = type(model).__name__
    if layout.wrapper == "fully_shard" and blocks is None:
        raise TrainConfigError(
            f"{flag}: --fsdp shards one unit per block, but {name} declares no blocks: "
            f"give it {BLOCKS} = 'attribute name of its ModuleList of blocks' (or a method "
            "returning them; see cadence.models.protocol), or train it without --fsdp"
        )
    if cfg.ac != "none" and blocks is None:
        raise TrainConfigError(
            f"{flag}: --ac {cfg.ac} checkpoints each block, but {name} declares no blocks: "
            f"give it {BLOCKS} = 'attribute name of its ModuleList of blocks' (or a method "
            "returning them; see cadence.models.protocol), or drop --ac"
        )
    if layout.pp > 1:
        if cfg.model_factory.startswith("hf:"):
            raise TrainConfigError(
                f"{flag}: pipelines are not offered for transformers models (their layers "
                "take position ids, masks and rotary tables from the base model, so a layer "
                "is not a stage on its own); use --fsdp or data parallelism"
            )
        if not can_split(model):
            raise TrainConfigError(
                f"{flag}: --pp cuts the model into stages, but {name} declares no cut: give it "
                f"{SPLIT}(n) -> list of nn.Modules, or {PARTS} = (names before the blocks, "
                f"its {BLOCKS}, names after; see cadence.models.protocol), or drop --pp"
            )
        stages = layout.stages
        if blocks is not None and len(blocks) < stages:
            raise TrainConfigError(
                f"{flag}: {name} has {len(blocks)} blocks, fewer than the {stages} pipeline "
                f"stages (--pp {layout.pp} x chunks {layout.chunks}); give it more layers"
            )
        try:  # the model's own cut refuses what it cannot cut (tied embeddings, ...)
            split_model(model, stages)
        except (BlockProtocolError, ValueError) as exc:
            raise TrainConfigError(f"{flag}: {exc}") from None
    _check_logits(cfg, model)


def _check_logits(cfg: TrainConfig, model: nn.Module) -> None:
    """The model's output, traced on the meta device, has the contract's shape. A model
    whose forward cannot run on the meta device is left to the ranks."""
    t, vocab = cfg.model.seq_len, cfg.model.vocab_size
    flag = f"--model {cfg.model_factory}"
    if isinstance(model, HFCausalLM):  # its forward calls .item(): no meta trace
        have = getattr(model.model.config, "vocab_size", vocab)
        if have < vocab:
            raise TrainConfigError(
                f"{flag}: its vocab_size is {have}, but the data has {vocab} token ids: "
                f"give vocab_size {vocab} or more in --model-config (or leave it out)"
            )
        return
    try:
        out = model(torch.zeros(1, t, dtype=torch.long, device="meta"))
    except Exception:
        return
    logits = getattr(out, "logits", out)
    shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else None
    if shape is None or len(shape) != 3 or shape[:2] != (1, t):
        raise TrainConfigError(
            f"{flag}: forward(ids of shape (1, {t})) must return logits of shape "
            f"(1, {t}, vocab) (or an object whose .logits is), got "
            f"{shape if shape is not None else type(out).__name__}"
        )
    if shape[2] < vocab:
        raise TrainConfigError(
            f"{flag}: its logits cover {shape[2]} token ids, but the data has {vocab}: give "
            f"the model vocab_size {vocab} or more in --model-config"
        )
