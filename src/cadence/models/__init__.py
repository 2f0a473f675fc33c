"""The embedded model and data behind `cadence train` (nothing is downloaded)."""

from cadence.models.data import MarkovTokens
from cadence.models.gpt import GPTConfig, TinyGPT

__all__ = ["GPTConfig", "MarkovTokens", "TinyGPT"]
