"""``cadence train --compile``: precompile the model's forward once per group.

After wrapping, the module inside each wrapper (the whole TinyGPT, or each local
pipeline stage) gets its forward from `cadence.precompile_module`: one rank of the
data-parallel group compiles, the others receive the artifact, and the artifact is
cached (signed) in ``<run_dir>/precompile``, so a restarted or resumed job loads
instead of compiling again. The wrappers keep running their hooks eagerly around the
compiled forward, so gradient reductions happen exactly as without ``--compile``.

Pipeline stages are compiled each over the data-parallel group of its pipeline
position (`ParallelGroups` as ``group``): a stage's replicas share one compile.

With ``--fsdp`` the blocks are fully_shard units inside the root unit, and a compiled
root forward would have to run the blocks' all-gathers inside its graph, which
precompile refuses. So each block's forward is compiled instead (the blocks share one
architecture, so the later ones load the first one's artifact from the cache), and the
root's own forward (embedding, head) stays eager, like every fully_shard hook.

The embedded models only (TinyGPT, and ``--model llama``): a block's example input is
built from what their blocks take, one (B, T, D) activation. A ``transformers`` or
user block takes more than the block protocol describes (positions, masks), so
``--compile`` is refused for those before any rank starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from cadence.models.gpt import Block
from cadence.models.llama import LlamaBlock
from cadence.pipeline.runtime.stage import TensorMeta
from cadence.precompiling import precompile_module
from cadence.train.build import TrainState
from cadence.train.config import TrainConfig
from cadence.train.metrics import attention_shape

__all__ = ["compile_state"]

# The compiler backend; the tests use "aot_eager", which needs no C++ toolchain.
BACKEND = "inductor"


def _inner(module: nn.Module) -> nn.Module:
    """The module a wrapper wraps (DataParallel keeps it as ``.module``)."""
    return getattr(module, "module", module)


# The embedded models' blocks: each takes one (B, T, D) activation and returns one.
_BLOCKS = (Block, LlamaBlock)


def _width(cfg: TrainConfig) -> int:
    """D, the width of the activations between blocks (the embedded models say it)."""
    shape = attention_shape(cfg)
    assert shape is not None, "--compile is refused for models that do not give their width"
    return shape[1]


def _activations(cfg: TrainConfig, rows: int) -> torch.Tensor:
    """A block's input as the step gives it: (rows, T, D), requiring grad.

    fp32 also under ``--mixed-precision bf16``: precompile_module casts it as the
    block's fully_shard policy casts forward inputs.
    """
    return torch.zeros(rows, cfg.model.seq_len, _width(cfg)).requires_grad_()


def _targets(
    cfg: TrainConfig, wrapper: str, module: nn.Module, example: torch.Tensor
) -> list[tuple[nn.Module, torch.Tensor]]:
    """What to compile for one wrapped module: itself, or with ``--fsdp`` its blocks."""
    blocks = [m for m in module.modules() if isinstance(m, _BLOCKS)]
    if wrapper != "fully_shard" or not blocks:
        return [(module, example)]
    return [(block, _activations(cfg, example.shape[0])) for block in blocks]


def _examples(cfg: TrainConfig, state: TrainState) -> list[tuple[nn.Module, torch.Tensor]]:
    """(module to compile, an example input as the step will call it) for this rank."""
    layout = state.layout
    rows = state.groups.local_slice(cfg.batch_size)
    x, _ = state.data.batch(0, cfg.batch_size)
    x = x[rows]
    if state.runtime is None:
        assert state.model is not None
        return _targets(cfg, layout.wrapper, _inner(state.model), x)
    mb = x.shape[0] // layout.microbatches
    out = []
    for s in sorted(state.runtime.stages):
        module = _inner(state.runtime.stages[s].module)
        # Later stages get what the stage before sends: a fresh leaf per microbatch.
        example = x[:mb] if s == 0 else _activations(cfg, mb)
        _set_static_meta(state.runtime.stages[s], module, example)
        out += _targets(cfg, layout.wrapper, module, example)
    return out


def _set_static_meta(stage: Any, module: nn.Module, example: torch.Tensor) -> None:
    """Give a pipeline stage its input and output metadata up front.

    Otherwise the runtime infers them on its first step by calling the stage under
    ``torch.no_grad()``, and the compiled forward, guarded on grad mode, would refuse
    that call. Measured here with one eager call on the example.
    """
    with torch.no_grad():
        out = module(example)
    outs = out if isinstance(out, tuple) else (out,)
    if not stage.is_first:
        stage.input_meta = (TensorMeta.of(example),)
    stage.output_meta = tuple(TensorMeta.of(t) for t in outs)


def compile_state(cfg: TrainConfig, state: TrainState) -> dict[str, Any]:
    """Precompile this rank's modules; returns ``{"source": ..., "compile_s": ...}``
    (sources joined and seconds summed over this rank's stages)."""
    cache = Path(cfg.run_dir) / "precompile" if cfg.run_dir else None
    sources: list[str] = []
    totals = {"compile_s": 0.0, "load_s": 0.0, "wait_s": 0.0}
    for module, example in _examples(cfg, state):
        compiled = precompile_module(
            module, (example,), group=state.groups, cache_dir=cache, backend=BACKEND
        )
        sources.append(compiled.source)
        for key in totals:
            totals[key] += float(compiled.timings.get(key, 0.0))
    return {"source": ",".join(sources), **totals}
