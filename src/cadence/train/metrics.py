"""Throughput, model FLOPs utilization (MFU) and peak memory of a run.

[Note: FLOPs per token and MFU]
A training step does a forward and a backward per token. Per token the matmuls cost
``6 N`` FLOPs (2 forward, 4 backward per weight) where ``N`` counts the parameters
that multiply activations: every parameter but the embedding tables, which are
looked up, not multiplied (a table tied to the output head is counted once, as the
head). Attention adds ``12 L d T`` (the scores and the weighted values, forward and
backward, for ``L`` blocks of width ``d`` over a context of ``T``; PaLM's appendix B,
without halving for the causal mask):

    flops_per_token = 6 N + 12 L d T

``tokens_per_s`` is the job's: the global batch's tokens (``batch_size x seq_len``,
every replica's rows together) over the median step time. MFU divides the FLOPs the
job does per second by what its devices could do:

    mfu = tokens_per_s x flops_per_token / (peak_flops x world)

``peak_flops`` is one device's peak, which only the user knows (the dtype and the
chip decide it), so MFU is reported only when ``--peak-flops`` gives it.

``L`` and ``d`` are the trained model's own (`attention_shape`): TinyGPT's
``--layers``/``--d-model``, ``--model llama``'s ``n_layers``/``dim``, a
``transformers`` config's ``num_hidden_layers``/``hidden_size``. A factory model does
not say, so its attention term is left out and the summary says so, rather than
counted with numbers that belong to another model.

Torch is imported on call only: the report (`cadence.train.report`) computes the
summary's figures where torch may not be installed.

Peak memory is each rank's own: on CUDA ``torch.cuda.max_memory_allocated`` (the
tensors the allocator handed out), on CPU the process's maximum resident set size
(``resource.getrusage``: everything the process touched, the interpreter and torch
included).
"""

from __future__ import annotations

import math
import resource
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from cadence.train.config import TrainConfig

__all__ = ["attention_shape", "flop_params", "flops_per_token", "mfu", "peak_memory_bytes"]


def flop_params(modules: list[nn.Module]) -> int:
    """``N`` of [Note: FLOPs per token and MFU] for this rank's ``modules``: the
    parameters outside ``nn.Embedding`` tables, or shared with a module that is not
    one, each counted once (a fully_shard parameter by its whole size)."""
    from torch import nn  # on call: the summary's functions need no torch

    multiplied: dict[int, int] = {}
    for root in modules:
        for module in root.modules():
            if isinstance(module, nn.Embedding):
                continue
            for p in module.parameters(recurse=False):
                multiplied[id(p)] = p.numel()  # a DTensor's numel is the whole tensor's
    return sum(multiplied.values())


def attention_shape(cfg: TrainConfig) -> tuple[int, int] | None:
    """``(L, d)`` of the model ``cfg`` trains, or None when its ``--model`` does not say
    (see [Note: FLOPs per token and MFU])."""
    spec = cfg.model_factory
    if not spec:
        return cfg.model.n_layers, cfg.model.d_model
    if spec == "llama":
        from cadence.models.llama import LlamaConfig  # on call: it imports torch

        llama = LlamaConfig(**cfg.model_config)
        return llama.n_layers, llama.dim
    if spec.startswith("hf:"):
        from cadence.models.hf import hf_class  # on call: transformers

        cls: Any = hf_class(spec.removeprefix("hf:"))  # its config_class is untyped
        config = cls.config_class(**cfg.model_config)
        # The standard names; every transformers config maps its own onto them.
        layers = getattr(config, "num_hidden_layers", None)
        width = getattr(config, "hidden_size", None)
        if isinstance(layers, int) and isinstance(width, int):
            return layers, width
    return None


def flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> int:
    """``6 N + 12 L d T``: see [Note: FLOPs per token and MFU]."""
    return 6 * n_params + 12 * n_layers * d_model * seq_len


def mfu(
    tokens_per_s: float, per_token: int, peak_flops: float | None, world: int
) -> tuple[float | None, str]:
    """The MFU (a fraction) and how it was found, or None and why there is none."""
    if peak_flops is None:
        return None, "not measured: give --peak-flops (one device's peak FLOP/s)"
    if math.isnan(tokens_per_s) or tokens_per_s <= 0:  # NaN: no step timed
        return None, "not measured: no step was timed"
    achieved = tokens_per_s * per_token
    return achieved / (peak_flops * world), (
        f"{achieved:.3g} FLOP/s over {world} x {peak_flops:.3g} FLOP/s"
    )


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """This rank's peak memory and what was measured (see [Note: FLOPs per token and
    MFU])."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device)), "cuda max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return (rss if sys.platform == "darwin" else rss * 1024), "max RSS"
