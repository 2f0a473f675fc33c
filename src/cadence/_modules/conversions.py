"""What the wrappers share about the user's module: the nn.Module conversions they see.

``nn.Module._apply`` (``to``, ``cuda``, ``float``, ...) reaches a wrapped module's
parameters without the wrapper taking part. Both wrappers intercept it to refuse a
move their group cannot use before anything changes, and name the method the user
called in the message; the two helpers they share live here, so that neither wrapper
imports the other.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["conversion_name", "conversion_target"]

# nn.Module's methods that convert every tensor through ``_apply``.
_CONVERSIONS = frozenset(
    {"to", "to_empty", "cuda", "cpu", "xpu", "ipu", "mtia", "float", "double", "half"}
    | {"bfloat16", "type", "share_memory"}
)


def conversion_name() -> str:
    """The nn.Module method whose ``_apply`` is running (for messages), or ``_apply``."""
    module_file = nn.Module._apply.__code__.co_filename
    frame = sys._getframe(1)
    for _ in range(32):
        if frame is None:
            break
        code = frame.f_code
        if code.co_filename == module_file and code.co_name in _CONVERSIONS:
            return code.co_name
        frame = frame.f_back  # type: ignore[assignment]  # None at the outermost frame; the loop checks
    return "_apply"


def conversion_target(
    fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, device: torch.device
) -> tuple[torch.dtype, torch.device] | None:
    """Where ``fn`` would put a tensor of ``dtype`` on ``device``; None if unknown.

    Found on a fake tensor, so nothing is allocated and no device is initialised:
    a move the shard group cannot use is refused before any parameter is touched.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            out = fn(torch.empty(0, dtype=dtype, device=device))
    except Exception:
        return None  # fn does not run on a fake tensor: the checks after it still apply
    if not isinstance(out, torch.Tensor):
        return None
    return out.dtype, out.device
