"""Stage tensor metadata agreed by every pipeline rank before the first step.

See [Note: metadata and short messages] in ``stage.py`` for why every tensor that
crosses a boundary is checked against it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cadence.comm import Comm
from cadence.pipeline.runtime.stage import Stage, TensorMeta

__all__ = ["agree_metadata"]


def agree_metadata(
    stages: Mapping[int, Stage],
    placement: Sequence[int],
    pp_rank: int,
    pp_comm: Comm,
    first_microbatch: Sequence[Sequence[Any]],
) -> None:
    """Agree on every stage's input/output metadata, once, before the first step.

    Collective over the pp group. One vote decides static vs inferred (all ranks
    must take the same branch, or they would disagree on the broadcasts that
    follow). Inference runs each stage once on zeros in stage order, in eval mode
    so that running statistics are not updated, and broadcasts its output
    metadata. ``first_microbatch``: ``[inputs of microbatch 0]`` (or empty).
    """
    complete = all(
        st.output_meta is not None and (st.is_first or st.input_meta is not None)
        for st in stages.values()
    )
    # A flag in one fixed-size all-reduce: the same bytes per rank at any pp degree.
    if not pp_comm.agree(flags=(not complete,)).raised[0]:
        return
    mb0 = first_microbatch[0] if first_microbatch else ()
    for s, owner in enumerate(placement):
        meta = None
        if owner == pp_rank:
            meta = _infer_stage(stages[s], mb0)
        meta = pp_comm.broadcast_object(meta, src=owner)
        nxt = stages.get(s + 1)
        if nxt is not None and nxt.input_meta is None:
            nxt.input_meta = tuple(meta)


def _infer_stage(stage: Stage, mb0: Sequence[Any]) -> tuple[TensorMeta, ...]:
    if stage.is_first:
        inputs = tuple(mb0)
        if all(isinstance(t, torch.Tensor) for t in inputs):
            stage.input_meta = tuple(TensorMeta.of(t) for t in inputs)
    else:
        assert stage.input_meta is not None  # broadcast by the stage before it
        inputs = tuple(m.empty(stage.device).zero_() for m in stage.input_meta)
    was_training = stage.module.training
    stage.module.eval()
    try:
        return stage.infer_output_meta(inputs)
    finally:
        stage.module.train(was_training)
