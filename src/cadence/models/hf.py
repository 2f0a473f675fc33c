"""Hugging Face ``transformers`` causal LMs built from a config (no weights downloaded).

``cadence train --model hf:LlamaForCausalLM --model-config '{"hidden_size": 64, ...}'``
builds ``LlamaForCausalLM(LlamaConfig(**config))`` inside `HFCausalLM`, a thin adapter
that gives it cadence's model contract: ``forward(ids) -> logits`` (B, T, V), and the
block protocol's ``cadence_blocks`` (`cadence.models.protocol`), found from the
model's own ``_no_split_modules`` (the decoder layer classes ``transformers`` never
splits across devices: ``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ...), so
``--fsdp`` shards one unit per decoder layer. Pipelines are not offered: a
``transformers`` model computes position ids, the attention mask and the rotary
tables once in its base model and passes them to every layer as keyword arguments,
so a layer alone is not a stage whose output feeds the next.

Needs the ``hf`` extra (``pip install cadence[hf]``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cadence.errors import CadenceValueError

__all__ = ["HFCausalLM", "hf_causal_lm", "hf_class"]


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM whose ``forward`` returns the logits tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def cadence_blocks(self) -> list[nn.Module]:
        """The modules of the classes the model's ``_no_split_modules`` names."""
        names = set(getattr(self.model, "_no_split_modules", None) or ())
        return [m for m in self.model.modules() if type(m).__name__ in names]

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=idx_BT, use_cache=False).logits
        return logits


def hf_class(class_name: str) -> type[nn.Module]:
    """``transformers.<class_name>``, a model class with a ``config_class``; raises
    `CadenceValueError` naming the fix when there is none (or no transformers)."""
    try:
        import transformers
    except ImportError:
        raise CadenceValueError(
            f"--model hf:{class_name} needs the transformers package: "
            "pip install 'cadence[hf]' (or transformers)"
        ) from None
    cls = getattr(transformers, class_name, None)
    if not (
        isinstance(cls, type)
        and issubclass(cls, nn.Module)
        and getattr(cls, "config_class", None) is not None
    ):
        raise CadenceValueError(
            f"--model hf:{class_name}: transformers {transformers.__version__} has no model "
            "class of that name; give one such as LlamaForCausalLM or Qwen2ForCausalLM"
        )
    return cls


def hf_causal_lm(class_name: str, **config: Any) -> HFCausalLM:
    """``transformers.<class_name>`` built from ``<its config class>(**config)``, with
    freshly initialised weights (the current torch seed)."""
    cls: Any = hf_class(class_name)  # a transformers class: its config_class is untyped
    return HFCausalLM(cls(cls.config_class(**config)))
