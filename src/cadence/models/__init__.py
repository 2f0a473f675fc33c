"""The embedded models and data behind `cadence train` (nothing is downloaded).

Names are imported on first use, so `GPTConfig` (``cadence.models.config``) can be
read without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence._util.lazy import lazy_getattr

_LAZY = {
    "GPTConfig": "cadence.models.config:GPTConfig",
    "Llama": "cadence.models.llama:Llama",
    "LlamaConfig": "cadence.models.llama:LlamaConfig",
    "MarkovTokens": "cadence.models.data:MarkovTokens",
    "TinyGPT": "cadence.models.gpt:TinyGPT",
}

__getattr__ = lazy_getattr("cadence.models", _LAZY, globals())

if TYPE_CHECKING:  # static tools see the eager imports
    from cadence.models.config import GPTConfig
    from cadence.models.data import MarkovTokens
    from cadence.models.gpt import TinyGPT
    from cadence.models.llama import Llama, LlamaConfig

__all__ = ["GPTConfig", "Llama", "LlamaConfig", "MarkovTokens", "TinyGPT"]
