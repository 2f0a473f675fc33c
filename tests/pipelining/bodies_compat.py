"""Rank bodies of the drop-in tests: torch's pipelining tutorial, run twice per launch.

Each body runs the same script twice on the same ranks and seeds: once with
``torch.distributed.pipelining``, once with ``cadence.pipelining`` (only the module
the names come from differs, as in the tutorial with its import line changed), and
returns both runs' numbers; the parent asserts. The model is the tutorial's
``Transformer`` (embedding, ``nn.TransformerDecoderLayer`` blocks with their
dropout, norm, head), scaled down to run on one CPU thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist
import torch.distributed.pipelining as torch_api
from torch import nn

import cadence.pipelining as cadence_api
from cadence.pipeline.runtime.errors import PipelineUsageError
from cadence.testing import run_subtests

APIS = {"torch": torch_api, "cadence": cadence_api}
N_MICROBATCHES = 4
STEPS = 3
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


@dataclass
class ModelArgs:
    dim: int = 16
    n_layers: int = 4
    n_heads: int = 2
    vocab_size: int = 64
    ffn: int = 32


class Transformer(nn.Module):
    """The tutorial's model (``dim_feedforward`` made small; dropout kept)."""

    def __init__(self, model_args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.layers = torch.nn.ModuleDict()
        for layer_id in range(model_args.n_layers):
            self.layers[str(layer_id)] = nn.TransformerDecoderLayer(
                model_args.dim, model_args.n_heads, dim_feedforward=model_args.ffn
            )
        self.norm = nn.LayerNorm(model_args.dim)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
        for layer in self.layers.values():
            h = layer(h, h)
        h = self.norm(h) if self.norm else h
        return self.output(h).clone() if self.output else h


def _data(args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, args.vocab_size, (8, 6), generator=g)
    y = torch.randint(0, args.vocab_size, (8, 6), generator=g)
    return x, y


def _loss_fn(args: ModelArgs):
    def tokenwise_loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss_fn = nn.CrossEntropyLoss()
        return loss_fn(outputs.reshape(-1, args.vocab_size), targets.reshape(-1))

    return tokenwise_loss_fn


def _manual_stages(api: ModuleType, model: Transformer, stage_ids: list[int], num_stages: int):
    """The tutorial's manual split, generalised to ``num_stages`` chunks of the layers:
    one deep copy per stage this rank holds, with the other layers deleted."""
    import copy

    per = len(model.layers) // num_stages
    stages = []
    for s in stage_ids:
        chunk = copy.deepcopy(model)
        for i in range(len(model.layers)):
            if not s * per <= i < (s + 1) * per:
                del chunk.layers[str(i)]
        if s != 0:
            chunk.tok_embeddings = None
        if s != num_stages - 1:
            chunk.norm = None
            chunk.output = None
        stages.append(api.PipelineStage(chunk, s, num_stages, torch.device("cpu")))
    return stages


def _tracer_stage(api: ModuleType, model: Transformer, x_mb: torch.Tensor):
    """The tutorial's tracer split (before layer 2 of 4: two stages)."""
    pipe = api.pipeline(
        module=model, mb_args=(x_mb,), split_spec={"layers.2": api.SplitPoint.BEGINNING}
    )
    return pipe.build_stage(dist.get_rank(), torch.device("cpu"), dist.new_group())


def _dropout_is_live(model: Transformer, x: torch.Tensor) -> bool:
    """Two forwards of the training model under different seeds differ (dropout draws)."""
    with torch.no_grad():
        torch.manual_seed(1)
        a = model(x)
        torch.manual_seed(2)
        return not torch.equal(a, model(x))


def run_script(api_name: str, *, split: str, schedule: str, stages_per_rank: int = 1) -> dict:
    """The tutorial's main, with a few SGD steps; returns losses, grad_fn flags, parameters.

    ``split``: ``"manual"`` (the tutorial's manual split), ``"tracer"`` (``pipeline``
    and ``build_stage`` of the API under test) or ``"torch_tracer"`` (torch's
    ``pipeline`` and ``build_stage`` whatever the API: torch's stage object handed
    to the API's schedule).
    """
    api = APIS[api_name]
    rank, world = dist.get_rank(), dist.get_world_size()
    args = ModelArgs()
    torch.manual_seed(1234)
    model = Transformer(args)
    x, y = _data(args)
    dropout_live = _dropout_is_live(model, x)
    num_stages = world * stages_per_rank
    if split in ("tracer", "torch_tracer"):
        tracer_api = torch_api if split == "torch_tracer" else api
        stages = [_tracer_stage(tracer_api, model, x.chunk(N_MICROBATCHES)[0])]
    else:
        stage_ids = [rank + k * world for k in range(stages_per_rank)]
        if schedule in V_SHAPED:  # stage r and its mirror 2p - 1 - r
            stage_ids = [rank, 2 * world - 1 - rank]
        stages = _manual_stages(api, model, stage_ids, num_stages)
    cls = getattr(api, schedule)
    arg = (
        stages[0]
        if stages_per_rank == 1 and schedule in ("ScheduleGPipe", "Schedule1F1B")
        else stages
    )
    sched = cls(arg, n_microbatches=N_MICROBATCHES, loss_fn=_loss_fn(args))
    params = [p for st in stages for p in st.submod.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.8)
    holds_first = any(st.is_first for st in stages)
    holds_last = any(st.is_last for st in stages)
    torch.manual_seed(99)  # the dropout stream, the same for both runs
    losses_per_step, has_graph, outputs, output_graph = [], [], [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        losses: list = []
        inputs = (x,) if holds_first else ()
        if holds_last:
            out = sched.step(*inputs, target=y, losses=losses)
            outputs.append(out.detach())
            output_graph.append(out.grad_fn is not None)
        else:
            sched.step(*inputs)
        optimizer.step()
        losses_per_step.append(torch.stack([loss.detach() for loss in losses]) if losses else None)
        has_graph.append([loss.grad_fn is not None for loss in losses])
    eval_losses: list = []
    if schedule not in V_SHAPED:  # torch's eval() raises on its V schedules (the V turn)
        torch.manual_seed(5)
        sched.eval(*inputs, target=y if holds_last else None, losses=eval_losses)
    lowered = sched.lowered if api_name == "cadence" else None
    return {
        "dropout_live": dropout_live,
        "script_stage_types": [_type_name(st) for st in stages],
        "ran_stage_types": [_type_name(st) for st in sched.stages] if lowered is not None else None,
        "ran_generator": lowered.meta.generator if lowered is not None else None,
        "ran_lowered": lowered.meta.lowered if lowered is not None else None,
        "channels": sorted(sched.runtime.plan.edges) if lowered is not None else None,
        "losses": losses_per_step,
        "loss_has_grad_fn": has_graph,
        "outputs": outputs,
        "output_has_grad_fn": output_graph,
        "eval_losses": torch.stack([v.detach() for v in eval_losses]) if eval_losses else None,
        "params": [p.detach().clone() for p in params],
    }


def _both(config: tuple[str, str, int]) -> dict:
    """torch's run, then cadence's, on the same ranks and seeds."""
    split, schedule, stages_per_rank = config
    out = {}
    for api_name in ("torch", "cadence"):
        out[api_name] = run_script(
            api_name, split=split, schedule=schedule, stages_per_rank=stages_per_rank
        )
        dist.barrier()
    return out


def _type_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__name__}"


def body_both(configs: list[tuple[str, str, int]]) -> dict:
    return run_subtests({"config": configs}, _both)


def body_subgroup_refused() -> str:
    """A stage naming a group that is not the whole world is refused (on every rank)."""
    group = dist.new_group([0])  # collective: every rank creates it
    try:
        cadence_api.PipelineStage(nn.Linear(2, 2), 0, 2, torch.device("cpu"), group=group)
    except PipelineUsageError as e:
        return str(e)
    return "accepted"
