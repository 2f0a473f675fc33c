"""``cadence bench step``: whole training steps (forward, backward, optimizer) against torch.

`cadence bench dp` times forward and backward, where DataParallel does what DDP does.
What caller-owned timing buys shows only in a whole step: work that runs while
communication is in flight. Each case holds, in the same rank processes, stepped
interleaved (see [Note: interleaving] in ``_loop.py``):

- ``plain``: the same model and per-rank batch with no wrapper and no communication:
  the step time with communication removed, the limit any overlap approaches;
- ``cadence``: cadence's wrapper with its overlap;
- ``cadence_sync``: cadence's wrapper stepped as torch steps (no overlap): what the
  overlap itself gains, apart from the wrapper;
- ``torch`` and ``torch_b``: torch's own wrapper, stepped after backward (A/A).

Cases:

- ``dense_adamw``: 12 x Linear(512) with AdamW; ``cadence`` is DataParallel with
  `DataParallel.overlap_optimizer`, so each bucket's parameters are stepped while later
  buckets are still reducing; torch is DDP + ``opt.step()`` (target <= 0.85).
- ``fsdp_adamw``: the same model sharded, one unit per block plus the root; ``cadence``
  is fully_shard with ``overlap_optimizer`` (each unit's shards stepped once its
  reduce-scatter is waited, later units still reducing); torch is FSDP2 +
  ``opt.step()`` (target <= 0.50).
- ``recommender``: an ``EmbeddingBag(sparse=True)`` outside the wrapper feeding a dense
  tower. cadence's two variants exchange the bag's gradient as its lookups
  (`EmbeddingExchange`: each rank's ids and pooled output gradient, not the table's
  rows; fewer bytes, counted per variant); torch's all-reduce the sparse gradient.
  ``cadence`` finalizes manually with its last buckets held while the wire is
  busy (``hold_last_buckets(3, only_while_busy=True)``): backward launches the others
  and, at its end, the exchange (on a second group), which is waited first; then
  ``finalize_backward`` launches the held buckets, the sparse step runs while they
  fly, and each bucket's dense SGD is stepped as it lands (``overlap_optimizer``); torch
  runs the sparse half after DDP's backward (target <= 0.80), and torch's best the
  same order as cadence through DDP's own manual finalization, stepping the dense
  optimizer whole. ``cadence_sync`` (the exchange, no overlap) against ``torch`` is
  what the bytes alone are worth; ``cadence`` against ``cadence_sync``, the timing.
- ``nanogpt_dp``: nanoGPT's training loop on cadence's TinyGPT shaped like nanoGPT's
  GPT-2 small, scaled down to a CPU (6 blocks of width 128, LayerNorms and biases, tied
  embeddings: many small parameters), AdamW with nanoGPT's decay groups, 4 microbatches
  accumulated with ``require_backward_grad_sync`` False on all but the last, as nanoGPT
  does, no clipping (a global norm needs every reduced gradient, so nothing would be
  left to overlap). ``cadence`` is DataParallel with ``overlap_optimizer``; torch is
  DDP + ``opt.step()`` (target <= 1.00).
- ``nanogpt_fsdp``: the same loop sharded, a unit per block plus the root, the
  non-final microbatches under ``set_requires_gradient_sync(False)`` as torch's FSDP2
  docs accumulate; ``cadence`` is fully_shard with ``overlap_optimizer``; torch is FSDP2
  + ``opt.step()`` (target <= 1.00).
- ``pipeline``: the same GPT (untied) cut into 2 stages, 1F1B over 4 microbatches, at
  world 4 = pp 2 x dp 2, in its own launch (see [Note: a case with its own world]).
  Each stage is wrapped across its 2 replicas and has its own AdamW. ``cadence`` is
  cadence's runtime over DataParallel stages with ``overlap_optimizer``: the runtime
  issues a stage's reduction right after its last backward (REDUCE_GRAD, before that
  gradient is sent on) and waits it at WAIT_REDUCE_GRAD, and that wait steps each
  bucket as it completes, so a stage steps its optimizer as soon as its deferred
  reduction lands, while the stage before it is still in its last backward;
  ``opt.step()`` after the runtime's step only finishes what is left. torch is
  ``torch.distributed.pipelining``'s ``Schedule1F1B`` over DDP stages (torch arms the
  DDP reduction in the last backward, which waits it before the gradient is sent on)
  + ``opt.step()`` after the schedule. ``plain`` is cadence's runtime over unwrapped
  stages: the pipeline with the data-parallel reduction removed (target <= 0.90).

``torch_best``, where it differs from the plain loop ``torch`` runs, is torch's
strongest configuration of the case's pattern: DDP with its optimizer fused into the
reduction (``_register_fused_optim``: each parameter stepped as its bucket's all-reduce
completes) for ``dense_adamw``, DDP's own manual finalization (torch 2.15) with the
sparse exchange run while its buckets fly for ``recommender``; the row's ``ratio_best`` is
cadence over it.

On an emulated link (``cadence bench step --link RATE``, `cadence.link`), each row also
has ``link``: the bytes each variant puts on the wire per step and the figures of the
bound (see [Note: the bound perfect overlap allows] in ``_bound.py``), and ``trace``:
one more step of every variant with its phase marks and cadence's collectives, drawn
as the case's timeline picture beside the record.

Reported per case: step time ratio and A/A, in ``extra`` each variant's step time as a
multiple of ``plain`` (``limit_*``: 1.00 would mean communication fully hidden), how
many cores each variant keeps busy and cadence's CPU time over torch's (see [Note:
where a step's time goes on a CPU machine]), and in
``losses`` each variant's training loss at its first two steps on one rank (the rank of
a replica's last stage, for the pipeline): the first from the same weights, so equal
in every variant, the second after one update, where every data-parallel variant
agrees (``plain``, which averages no gradient, does not). That is the check that the
variants train the same model; the tiny test asserts it.

[Note: a case with its own world]
A case whose spec names a ``world`` runs in a launch of its own at that world; the
others share one launch at ``run``'s ``world``. The pipeline needs replicas of each
stage for a reduction to exist, so it needs pp x dp ranks; the single-model cases keep
world 2, which a 2-core machine runs without oversubscribing. World 4 on 2 cores
oversubscribes: read the pipeline's ratio, not its times.
"""

from __future__ import annotations

import copy
import functools
import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from cadence.bench._bound import link_figures
from cadence.bench._loop import (
    device_and_backend,
    device_sync,
    interleave,
    launch_ranks,
    loadavg,
    rank_device,
    slowest_per_rep,
)
from cadence.bench._ready_times import GradReadyTimes
from cadence.bench._record import make_record, paired_ratios, ratio_summary, timed_row
from cadence.errors import CadenceValueError

__all__ = ["CASES", "TINY", "rank_body", "run", "timeline_path", "write_chart"]

VARIANTS = ("plain", "cadence", "cadence_sync", "torch", "torch_b")
# torch's strongest configuration of the case's pattern, where it is not the plain loop
# ``torch`` already runs: DDP's own manual finalization for the recommender, DDP's
# optimizer fused into its reduction (``_register_fused_optim``) for dense AdamW.
TORCH_BEST = "torch_best"

CASES: dict[str, dict[str, Any]] = {
    "dense_adamw": {"what": "12 x [Linear(512) + GELU] + Linear(512, 1), AdamW, batch 128/rank",
                    "kind": "dense", "layers": 12, "width": 512, "batch": 128, "target": 0.85},
    "fsdp_adamw": {"what": "12 x [Linear(512) + GELU] + Linear(512, 1), a unit per block, "
                           "AdamW, batch 128/rank",
                   "kind": "fsdp", "layers": 12, "width": 512, "batch": 128, "target": 0.50},
    "recommender": {"what": "EmbeddingBag(200000 x 64, sparse) + 6 x Linear(512) tower, "
                            "SGD, batch 256/rank, bags of 16",
                    "kind": "recommender", "vocab": 200_000, "dim": 64, "layers": 6,
                    "width": 512, "batch": 256, "bag": 16, "hold": 3, "target": 0.80},
    "nanogpt_dp": {"what": "nanoGPT-shaped TinyGPT: 6 blocks, width 128, 4 heads, "
                           "vocab 512 (tied), seq 64, 4 microbatches of 2/rank, AdamW",
                   "kind": "nanogpt_dp", "layers": 6, "width": 128, "heads": 4, "vocab": 512,
                   "seq": 64, "batch": 2, "accum": 4, "target": 1.00},
    "nanogpt_fsdp": {"what": "nanoGPT-shaped TinyGPT: 6 blocks, width 128, 4 heads, "
                             "vocab 512 (tied), seq 64, a unit per block, 4 microbatches "
                             "of 2/rank, AdamW",
                     "kind": "nanogpt_fsdp", "layers": 6, "width": 128, "heads": 4,
                     "vocab": 512, "seq": 64, "batch": 2, "accum": 4, "target": 1.00},
    "pipeline": {"what": "nanoGPT-shaped TinyGPT: 6 blocks, width 128, 4 heads, vocab 512, "
                         "seq 64, 2 stages, 1F1B, 4 microbatches of 2/replica, pp 2 x dp 2, "
                         "AdamW per stage",
                 "kind": "pipeline", "world": 4, "pp": 2, "schedule": "1f1b", "layers": 6,
                 "width": 128, "heads": 4, "vocab": 512, "seq": 64, "batch": 2, "accum": 4,
                 "target": 0.90},
}  # fmt: skip
TINY: dict[str, dict[str, Any]] = {
    "dense_adamw": {"what": "tiny", "kind": "dense", "layers": 2, "width": 16, "batch": 4,
                    "target": 0.85},
    "fsdp_adamw": {"what": "tiny", "kind": "fsdp", "layers": 2, "width": 16, "batch": 4,
                   "target": 0.50},
    "recommender": {"what": "tiny", "kind": "recommender", "vocab": 64, "dim": 4, "layers": 2,
                    "width": 16, "batch": 4, "bag": 3, "hold": 1, "target": 0.80},
    "nanogpt_dp": {"what": "tiny", "kind": "nanogpt_dp", "layers": 2, "width": 16, "heads": 2,
                   "vocab": 32, "seq": 8, "batch": 2, "accum": 4, "target": 1.00},
    "nanogpt_fsdp": {"what": "tiny", "kind": "nanogpt_fsdp", "layers": 2, "width": 16,
                     "heads": 2, "vocab": 32, "seq": 8, "batch": 2, "accum": 4, "target": 1.00},
    "pipeline": {"what": "tiny", "kind": "pipeline", "world": 4, "pp": 2, "schedule": "1f1b",
                 "layers": 2, "width": 16, "heads": 2, "vocab": 32, "seq": 8, "batch": 1,
                 "accum": 4, "target": 0.90},
}  # fmt: skip
BUCKET_CAP_MB = 1.0

Steps = dict[str, Callable[[], None]]


class _CaseProbe:
    """What a case records besides its times.

    - Each variant's loss at its first two steps (see the module docstring), kept as
      detached tensors so that noting one costs no device synchronization.
    - What the bound of [Note: the bound perfect overlap allows] needs: the ``plain``
      variant's step cut in three (before its last backward, that backward, after
      it), ``meta`` (how many pieces the reduction comes in, a stage's bytes), for
      a pipeline ``releases`` (when each bucket's gradients landed in ``plain``), and
      ``late``: per variant, the exchange that cannot start before the last backward
      ends (the recommender's sparse one), a call whose bytes on the link are counted
      apart.
    - On a link, one traced step per variant (`trace`): what its timeline draws.
    """

    def __init__(self) -> None:
        from cadence.comm import EventLog

        self.seen: dict[str, list[Any]] = {k: [] for k in (*VARIANTS, TORCH_BEST)}
        self.phases: list[list[float]] = []
        # Per variant and step: the CPU seconds of this rank (every thread) from the start
        # of its last backward to the step's end, what the cores' share of the bound
        # reads (see [Note: the cores after the last backward starts] in _bound.py).
        self.cpu_after: dict[str, list[float]] = {k: [] for k in (*VARIANTS, TORCH_BEST)}
        self._cpu_marks: dict[str, list[float]] = {}
        self.meta: dict[str, Any] = {}
        # Per ``plain`` step, when each bucket's gradients were ready (a pipeline's; see
        # `_ready_times`), ms from the step's start.
        self.releases: list[list[float]] = []
        self.late: dict[str, Callable[[], None]] = {}
        self._marks: list[float] = []
        # The traced step of each variant (see `trace`): its phase marks; and the log
        # of cadence's variant's collectives, which its wrapper records into.
        self.tracing = False
        self.traced: dict[str, list[float]] = {}
        self.log = EventLog(capacity=4096)

    def wants(self, k: str) -> bool:
        return len(self.seen[k]) < 2

    def note(self, k: str, loss: Any) -> None:
        if self.wants(k):
            self.seen[k].append(loss.detach().float())

    def trace(self, steps: Steps) -> dict[str, Any]:
        """One more step of every variant, one after the other, with every variant's
        phase marks and cadence's collectives kept, times relative to each step's start,
        and on rank 0 the link's bytes sampled through it (`_wire_trace`): what a
        timeline picture draws."""
        import torch.distributed as dist

        from cadence.bench._wire_trace import WireSampler

        self.tracing = True
        out: dict[str, dict[str, list[Any]]] = {}
        for k, fn in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            wire = WireSampler(t0)
            if dist.get_rank() == 0:  # the one counter holds every rank's bytes
                with wire:
                    fn()
            else:
                fn()
            out[k] = {"marks": [t - t0 for t in self.traced.get(k, [])], "wire": wire.samples}
            if k == "cadence":
                out[k]["events"] = [
                    (
                        e.kind,
                        e.group,
                        e.issue_t - t0,
                        _rel(e.wait_start_t, t0),
                        _rel(e.wait_end_t, t0),
                    )
                    for e in self.log.collectives()
                    if e.issue_t >= t0
                ]
        self.tracing = False
        return out

    def floats(self) -> dict[str, list[float]]:
        return {k: [float(x) for x in v] for k, v in self.seen.items() if v}

    def mark(self, k: str, *, last: bool = False) -> None:
        """A phase boundary of variant ``k``'s step: its start, the start of its last
        backward, that backward's end, then the step's end. Kept for ``plain`` at every
        step (the bound's phases) and for every variant while tracing."""
        if self.tracing:
            device_sync()()
            self.traced.setdefault(k, []).append(time.perf_counter())
        cpu_marks = self._cpu_marks.setdefault(k, [])
        cpu_marks.append(time.process_time())
        if last:
            self.cpu_after[k].append(cpu_marks[-1] - cpu_marks[1])
            cpu_marks.clear()
        if k != "plain":
            return
        device_sync()()
        self._marks.append(time.perf_counter())
        if last:
            t = self._marks
            self.phases.append([b - a for a, b in itertools.pairwise(t)])
            self._marks = []


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else t - t0


def _bucket_bytes(dp: Any) -> list[int]:
    """Each bucket's bytes, in launch order (the order backward fills them)."""
    params = dict(dp.module.named_parameters())
    return [
        sum(params[n].numel() * params[n].element_size() for n in names)
        for names in dp.bucket_param_names()
    ]


def _bucket_meta(dp: Any) -> dict[str, Any]:
    """How many buckets a DataParallel reduces in, and each one's share of the bytes
    in launch order: the bound's ``pieces`` and ``shares``."""
    sizes = _bucket_bytes(dp)
    return {"pieces": len(sizes), "shares": [x / sum(sizes) for x in sizes]}


def _tower(layers: int, width: int, d_in: int) -> Any:
    from torch import nn

    mods: list[nn.Module] = [nn.Linear(d_in, width), nn.GELU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*mods, nn.Linear(width, 1))


def _ddp(model: Any, device: str, group: Any = None) -> Any:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    kw: dict[str, Any] = {"bucket_cap_mb": BUCKET_CAP_MB, "process_group": group}
    if device != "cpu":
        kw["device_ids"] = [torch.cuda.current_device()]
    return DDP(model, **kw)


def _dense_steps(spec: dict[str, Any], rank: int, device: str) -> tuple[Steps, _CaseProbe]:
    """One closure per variant: zero_grad, forward, backward, AdamW step."""
    import torch

    from cadence.data_parallel import DataParallel

    torch.manual_seed(0)
    base = _tower(spec["layers"] - 1, spec["width"], spec["width"]).to(device)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(spec["batch"], spec["width"], generator=g).to(device)
    losses = _CaseProbe()
    models = {
        "plain": copy.deepcopy(base),
        "cadence": DataParallel(
            copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB, event_log=losses.log
        ),
        "cadence_sync": DataParallel(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB),
        "torch": _ddp(copy.deepcopy(base), device),
        "torch_b": _ddp(copy.deepcopy(base), device),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    models["cadence"].overlap_optimizer(opts["cadence"])
    # torch's own optimizer-in-backward: DDP steps each parameter as its bucket's
    # all-reduce completes (the functional AdamW, same arithmetic as opts' AdamW).
    models[TORCH_BEST] = _ddp(copy.deepcopy(base), device)
    models[TORCH_BEST]._register_fused_optim(torch.optim.AdamW, lr=1e-4)
    losses.meta.update(_bucket_meta(models["cadence"]))

    def step(k: str) -> None:
        losses.mark(k)
        if k in opts:
            opts[k].zero_grad(set_to_none=True)
        loss = models[k](x).float().pow(2).mean()
        losses.mark(k)
        loss.backward()
        losses.mark(k)
        losses.note(k, loss)
        if k in opts:  # torch_best stepped inside its backward
            opts[k].step()
        losses.mark(k, last=True)

    return {k: functools.partial(step, k) for k in (*VARIANTS, TORCH_BEST)}, losses


def _sharded(
    impl: str,
    base: Any,
    device: str,
    blocks: Callable[[Any], list[Any]] | None = None,
    event_log: Any = None,
) -> Any:
    """``base`` with one unit per block and the root, by cadence or torch FSDP2; the
    blocks are ``blocks(model)``, by default every Linear but the last."""
    import torch.distributed as dist
    from torch import nn

    model = copy.deepcopy(base)
    units = (
        blocks(model) if blocks is not None else [m for m in model if isinstance(m, nn.Linear)][:-1]
    )
    if impl == "cadence":
        from cadence.fsdp import fully_shard

        for b in units:
            fully_shard(b, event_log=event_log)
        return fully_shard(model, event_log=event_log)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh(device.split(":")[0], (dist.get_world_size(),))
    for b in units:
        torch_fully_shard(b, mesh=mesh)
    return torch_fully_shard(model, mesh=mesh)


def _fsdp_steps(spec: dict[str, Any], rank: int, device: str) -> tuple[Steps, _CaseProbe]:
    """One closure per variant: zero_grad, forward, backward, AdamW step, sharded."""
    import torch

    torch.manual_seed(0)
    base = _tower(spec["layers"] - 1, spec["width"], spec["width"]).to(device)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(spec["batch"], spec["width"], generator=g).to(device)
    losses = _CaseProbe()
    models = {"plain": copy.deepcopy(base)}
    for k in VARIANTS[1:]:
        impl = "cadence" if k.startswith("cadence") else "torch"
        log = losses.log if k == "cadence" else None
        models[k] = _sharded(impl, base, device, event_log=log)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    models["cadence"].overlap_optimizer(opts["cadence"])
    losses.meta["pieces"] = spec["layers"]  # a unit per block but the head, and the root

    def step(k: str) -> None:
        losses.mark(k)
        opts[k].zero_grad(set_to_none=True)
        loss = models[k](x).float().pow(2).mean()
        losses.mark(k)
        loss.backward()
        losses.mark(k)
        losses.note(k, loss)
        opts[k].step()
        losses.mark(k, last=True)

    return {k: functools.partial(step, k) for k in VARIANTS}, losses


def _recommender_steps(spec: dict[str, Any], rank: int, device: str) -> tuple[Steps, _CaseProbe]:
    """Sparse embedding outside the wrapper, dense tower inside; SGD on both."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cadence.comm import Comm
    from cadence.data_parallel import DataParallel, EmbeddingExchange

    torch.manual_seed(0)
    bag = nn.EmbeddingBag(spec["vocab"], spec["dim"], mode="mean", sparse=True).to(device)
    tower = _tower(spec["layers"], spec["width"], spec["dim"]).to(device)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["bag"]), generator=g).to(device)
    # Every variant's sparse exchange runs on its own group, so it never queues behind
    # the dense buckets still in flight on the wrappers' group.
    # Every rank is a member (no ranks=), so new_group returns a ProcessGroup.
    sparse_group = cast(
        dist.ProcessGroup, dist.new_group(backend="gloo" if device == "cpu" else None)
    )
    losses = _CaseProbe()
    sparse_comm = Comm(sparse_group, name="sparse", event_log=losses.log)
    bags = {k: copy.deepcopy(bag) for k in VARIANTS}
    towers: dict[str, Any] = {"plain": copy.deepcopy(tower)}
    for k in ("cadence", "cadence_sync"):
        log = losses.log if k == "cadence" else None
        towers[k] = DataParallel(copy.deepcopy(tower), bucket_cap_mb=BUCKET_CAP_MB, event_log=log)
    towers["cadence"].require_manual_backward_finalization = True
    for k in ("torch", "torch_b"):
        towers[k] = _ddp(copy.deepcopy(tower), device)
    names = list(VARIANTS)
    # torch's strongest configuration of the pattern (2.15): DDP's own manual
    # finalization, the sparse half run while DDP's buckets are in flight.
    if hasattr(DDP, "require_manual_backward_finalization"):
        bags[TORCH_BEST] = copy.deepcopy(bag)
        towers[TORCH_BEST] = _ddp(copy.deepcopy(tower), device)
        towers[TORCH_BEST].require_manual_backward_finalization = True
        names.append(TORCH_BEST)
    dense_opts = {k: torch.optim.SGD(t.parameters(), lr=1e-3) for k, t in towers.items()}
    sparse_opts = {k: torch.optim.SGD(b.parameters(), lr=1e-3) for k, b in bags.items()}
    # The seed's timing: cadence's dense optimizer is stepped per bucket, as each
    # bucket's reduction is waited inside finalize_backward (SGD's arithmetic either
    # way, so parameters stay equal to the other variants').
    towers["cadence"].overlap_optimizer(dense_opts["cadence"])
    # ... and the sparse exchange has the wire first: the buckets backward fills last
    # wait for finalize while the wire is busy, so the exchange, which can start only
    # when backward reaches the embedding, is not queued behind every dense byte; the
    # sparse step then runs while those buckets fly (see [Note: held buckets] in
    # data_parallel/_reducer.py). Where the wire keeps up with backward, a held bucket
    # that finds every launched one landed goes at once, as it would unheld.
    towers["cadence"].hold_last_buckets(
        min(spec["hold"], towers["cadence"].num_buckets), only_while_busy=True
    )
    losses.meta.update(_bucket_meta(towers["cadence"]))
    # cadence's variants exchange the bag's gradient as its lookups: each rank's ids
    # and pooled output gradient (see [Note: exchanging an embedding's gradient as its
    # inputs] in data_parallel/_embedding_exchange.py); torch's all-reduce its rows.
    exchanges = {k: EmbeddingExchange(bags[k], sparse_comm) for k in ("cadence", "cadence_sync")}
    # The bound counts the sparse exchange's bytes apart, per variant: it can start
    # only when backward ends (the embedding is the last gradient backward writes).
    # Each call exchanges a fresh copy of one step's gradient, as every step does.
    probe = copy.deepcopy(bag)
    probe(ids).sum().backward()
    assert probe.weight.grad is not None
    one_grad = probe.weight.grad
    pooled = copy.deepcopy(bag)
    pooled_exchange = EmbeddingExchange(pooled, sparse_comm)

    def exchange_rows() -> None:
        sparse_comm.all_reduce(one_grad.clone(), op="avg")

    def exchange_lookups() -> None:
        # The forward's 24-byte size gather is counted with it: a few hundred bytes
        # with the headers, against the exchange's 0.3 MiB a rank.
        pooled(ids).sum().backward()
        pooled_exchange.finalize()
        pooled.weight.grad = None

    for k in names:
        if k != "plain":
            losses.late[k] = exchange_lookups if k in exchanges else exchange_rows

    def sparse_half(k: str) -> None:
        grad = bags[k].weight.grad
        if k in exchanges:
            exchanges[k].finalize()
        elif k != "plain":
            assert grad is not None  # the backward just before wrote it
            sparse_comm.all_reduce(grad, op="avg")
        sparse_opts[k].step()

    def overlapped_half(k: str) -> None:
        """torch_best: the sparse exchange flies beside the dense buckets while the
        dense gradients are finalized, then the sparse step. cadence: the exchange goes
        first, then its step while the held buckets fly; each bucket is stepped as it
        lands."""
        if k == "cadence":
            exchanges[k].finalize()  # launched at the end of backward
            handle = towers[k].finalize_backward(async_op=True)  # launches the held ones
            sparse_opts[k].step()
            handle.wait()
            dense_opts[k].step()  # only what the buckets left (nothing)
            return
        grad = bags[k].weight.grad
        assert grad is not None  # the backward just before wrote it
        work = sparse_comm.all_reduce(grad, op="avg", async_op=True)
        towers[k].finalize_backward()
        dense_opts[k].step()
        work.wait()
        sparse_opts[k].step()

    def step(k: str) -> None:
        losses.mark(k)
        dense_opts[k].zero_grad(set_to_none=True)
        sparse_opts[k].zero_grad(set_to_none=True)
        loss = towers[k](torch.tanh(bags[k](ids))).float().pow(2).mean()
        losses.mark(k)
        loss.backward()
        losses.mark(k)
        losses.note(k, loss)
        # cadence and torch_best: backward only launched the dense buckets; the sparse
        # exchange joins them in flight. The others: backward already waited.
        if k in ("cadence", TORCH_BEST):
            overlapped_half(k)
        else:
            sparse_half(k)
            dense_opts[k].step()
        losses.mark(k, last=True)

    return {k: functools.partial(step, k) for k in names}, losses


# -- nanoGPT ----------------------------------------------------------------------


def _gpt(spec: dict[str, Any], *, tied: bool) -> Any:
    """cadence's TinyGPT at the case's shape, the same weights on every rank, initialized
    as nanoGPT does (normal(0, 0.02), zero biases): with the default N(0, 1) embedding
    tied to the head, the logits would start far too large for a sensible loss."""
    import torch
    from torch import nn

    from cadence.models.gpt import GPTConfig, TinyGPT

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=spec["vocab"],
        seq_len=spec["seq"],
        d_model=spec["width"],
        n_heads=spec["heads"],
        n_layers=spec["layers"],
        tie_embeddings=tied,
    )
    model = TinyGPT(cfg)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.zero_()
    return model


def _tokens(spec: dict[str, Any], seed: int, device: str) -> tuple[Any, Any]:
    """``accum`` microbatches of ``batch`` windows of ``seq`` tokens, and their next
    tokens: inputs and targets shaped (accum, batch, seq), as nanoGPT's get_batch."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (spec["accum"], spec["batch"], spec["seq"] + 1)
    seq = torch.randint(0, spec["vocab"], shape, generator=g).to(device)
    return seq[..., :-1].contiguous(), seq[..., 1:].contiguous()


def _gpt_loss(logits: Any, target: Any) -> Any:
    from cadence.models.gpt import TinyGPT

    return TinyGPT.loss(logits.float(), target)


def _nanogpt_adamw(model: Any, device: str) -> Any:
    """nanoGPT's ``configure_optimizers``: weight decay on matrices and embeddings only,
    betas (0.9, 0.95), fused on CUDA."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = {"fused": True} if device.startswith("cuda") else {}
    return torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), **fused)


def _nanogpt_loop(
    models: dict[str, Any], opts: dict[str, Any], spec: dict[str, Any], x: Any, y: Any,
    set_sync: Callable[[Any, bool], None], losses: _CaseProbe,
) -> tuple[Steps, _CaseProbe]:  # fmt: skip
    """nanoGPT's step: ``accum`` microbatches, the gradient synchronized on the last
    only (``set_sync(model, flag)``), then the optimizer step and ``zero_grad``."""
    accum = spec["accum"]

    def step(k: str) -> None:
        model, total = models[k], None
        losses.mark(k)
        for i in range(accum):
            if k != "plain":
                set_sync(model, i == accum - 1)
            loss = _gpt_loss(model(x[i]), y[i]) / accum
            if i == accum - 1:
                losses.mark(k)
            loss.backward()
            if losses.wants(k):
                total = loss.detach() if total is None else total + loss.detach()
        losses.mark(k)
        if total is not None:
            losses.note(k, total)
        opts[k].step()
        opts[k].zero_grad(set_to_none=True)
        losses.mark(k, last=True)

    return {k: functools.partial(step, k) for k in VARIANTS}, losses


def _nanogpt_dp_steps(spec: dict[str, Any], rank: int, device: str) -> tuple[Steps, _CaseProbe]:
    """DataParallel (+ overlap_optimizer) vs DDP, accumulating as nanoGPT does."""
    from cadence.data_parallel import DataParallel

    base = _gpt(spec, tied=True).to(device)
    x, y = _tokens(spec, rank, device)
    losses = _CaseProbe()
    models = {
        "plain": copy.deepcopy(base),
        "cadence": DataParallel(
            copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB, event_log=losses.log
        ),
        "cadence_sync": DataParallel(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB),
        "torch": _ddp(copy.deepcopy(base), device),
        "torch_b": _ddp(copy.deepcopy(base), device),
    }
    opts = {k: _nanogpt_adamw(m, device) for k, m in models.items()}
    models["cadence"].overlap_optimizer(opts["cadence"])

    def set_sync(model: Any, flag: bool) -> None:
        model.require_backward_grad_sync = flag  # nanoGPT's spelling, DDP's flag

    steps, losses = _nanogpt_loop(models, opts, spec, x, y, set_sync, losses)
    losses.meta.update(_bucket_meta(models["cadence"]))
    return steps, losses


def _nanogpt_fsdp_steps(spec: dict[str, Any], rank: int, device: str) -> tuple[Steps, _CaseProbe]:
    """fully_shard (+ overlap_optimizer) vs FSDP2, a unit per block plus the root."""
    base = _gpt(spec, tied=True).to(device)
    x, y = _tokens(spec, rank, device)
    losses = _CaseProbe()
    models = {"plain": copy.deepcopy(base)}
    for k in VARIANTS[1:]:
        impl = "cadence" if k.startswith("cadence") else "torch"
        log = losses.log if k == "cadence" else None
        models[k] = _sharded(impl, base, device, blocks=lambda m: list(m.blocks), event_log=log)
    opts = {k: _nanogpt_adamw(m, device) for k, m in models.items()}
    models["cadence"].overlap_optimizer(opts["cadence"])

    def set_sync(model: Any, flag: bool) -> None:
        model.set_requires_gradient_sync(flag)  # as torch's FSDP2 docs accumulate

    steps, losses = _nanogpt_loop(models, opts, spec, x, y, set_sync, losses)
    losses.meta["pieces"] = spec["layers"] + 1  # a unit per block, and the root
    return steps, losses


# -- pipeline ---------------------------------------------------------------------


def _pipeline_steps(spec: dict[str, Any], rank: int, device: str) -> tuple[Steps, _CaseProbe]:
    """pp x dp: cadence's runtime over DataParallel stages stepping as each stage's
    reduction completes, vs torch pipelining over DDP stages + ``opt.step()``. One
    stage per rank (GPipe, 1F1B): a rank's stage is its pipeline position."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    from cadence.data_parallel import DataParallel
    from cadence.pipeline.runtime import build_pipeline
    from cadence.pipeline.schedule import torch_schedule_name
    from cadence.topology import Topology

    pp, m = spec["pp"], spec["accum"]
    pg = Topology(dp_replicate=dist.get_world_size() // pp, pp=pp).build()
    stage = pg.pp_rank
    base = _gpt(spec, tied=False).to(device)  # tied weights cannot span stages

    def chunk() -> Any:
        # A copy's chunk keeps only its own modules: the other stages' are dropped.
        return copy.deepcopy(base).split_stages(pp)[stage]

    # One replica's batch, the same on both of its pipeline ranks (stage 0 reads the
    # tokens, the last stage the targets); another replica's differs.
    x, y = (t.flatten(0, 1) for t in _tokens(spec, pg.dp_rank, device))
    losses = _CaseProbe()
    mods: dict[str, Any] = {"plain": chunk()}
    for k in ("cadence", "cadence_sync"):
        log = losses.log if k == "cadence" else None
        mods[k] = DataParallel(chunk(), group=pg, bucket_cap_mb=BUCKET_CAP_MB, event_log=log)
    for k in ("torch", "torch_b"):
        mods[k] = _ddp(chunk(), device, group=pg.dp)
    opts = {k: _nanogpt_adamw(mod, device) for k, mod in mods.items()}
    # The wait of the stage's reduction (WAIT_REDUCE_GRAD) steps its buckets.
    mods["cadence"].overlap_optimizer(opts["cadence"])
    runtimes = {
        k: build_pipeline(spec["schedule"], {stage: mods[k]}, n_microbatches=m, groups=pg,
                          loss_fn=_gpt_loss, device=device,
                          event_log=losses.log if k == "cadence" else None)
        for k in ("plain", "cadence", "cadence_sync")
    }  # fmt: skip
    cls = ts.get_schedule_class(torch_schedule_name(spec["schedule"]))
    scheds = {
        k: cls(PipelineStage(mods[k], stage, pp, torch.device(device), group=pg.pp),
               n_microbatches=m, loss_fn=_gpt_loss)
        for k in ("torch", "torch_b")
    }  # fmt: skip
    buckets = mods["cadence"].bucket_param_names()
    losses.meta.update(
        pieces=mods["cadence"].num_buckets,
        stage=stage,
        stages=pp,
        microbatches=m,
        stage_param_bytes=sum(p.numel() * p.element_size() for p in mods["plain"].parameters()),
        bucket_bytes=[int(b) for b in _bucket_bytes(mods["cadence"])],
    )
    # The pipeline's bound reads when each of cadence's buckets could start: when its
    # gradients land in the variant that reduces nothing.
    ready = GradReadyTimes(mods["plain"], buckets)

    def step(k: str) -> None:
        mb_losses: list[Any] = []
        t0 = time.perf_counter()
        losses.mark(k)
        if k in runtimes:
            runtimes[k].step(x, target=y, losses=mb_losses)
        else:
            scheds[k].step(*((x,) if stage == 0 else ()), target=y, losses=mb_losses)
        if k == "plain":
            losses.releases.append(ready.take(t0))
        # The schedule's backwards are not cut out: the bound needs only the optimizer.
        losses.mark(k)
        losses.mark(k)
        if mb_losses and losses.wants(k):  # the last stage's ranks
            losses.note(k, torch.stack([t.detach().float() for t in mb_losses]).mean())
        opts[k].step()
        opts[k].zero_grad(set_to_none=True)
        losses.mark(k, last=True)

    return {k: functools.partial(step, k) for k in VARIANTS}, losses


_BUILDERS: dict[str, Callable[[dict[str, Any], int, str], tuple[Steps, _CaseProbe]]] = {
    "dense": _dense_steps,
    "fsdp": _fsdp_steps,
    "recommender": _recommender_steps,
    "nanogpt_dp": _nanogpt_dp_steps,
    "nanogpt_fsdp": _nanogpt_fsdp_steps,
    "pipeline": _pipeline_steps,
}


def _bytes_per_step(fn: Callable[[], None], n: int) -> int:
    """Bytes all ranks put on the link's loopback per call of ``fn`` (see
    `cadence.link.loopback_bytes`), the barriers around each call taken out."""
    import torch.distributed as dist

    from cadence.link import loopback_bytes

    def total(f: Callable[[], None]) -> int:
        dist.barrier()
        b0 = loopback_bytes()
        for _ in range(n):
            dist.barrier()
            f()
        dist.barrier()
        return loopback_bytes() - b0

    return max(0, (total(fn) - total(lambda: None)) // n)


def rank_body(cases: dict[str, dict[str, Any]], warmup: int, reps: int) -> dict[str, Any]:
    import torch.distributed as dist

    from cadence.link import active_link

    rank, device = dist.get_rank(), rank_device()
    on_link = active_link() is not None
    out: dict[str, Any] = {}
    for name, spec in cases.items():
        steps, losses = _BUILDERS[spec["kind"]](spec, rank, device)
        cpu: dict[str, list[float]] = {}
        times = interleave(steps, warmup=warmup, reps=reps, cpu=cpu)
        out[name] = {"times": times, "cpu": cpu, "losses": losses.floats(),
                     "phases": losses.phases[warmup:], "meta": losses.meta,
                     "releases": losses.releases[warmup:],
                     "cpu_after": {k: v[warmup:] for k, v in losses.cpu_after.items() if v}}  # fmt: skip
        if on_link:  # every rank reads the one shared counter; rank 0's is kept
            out[name]["wire_bytes"] = {k: _bytes_per_step(f, 3) for k, f in steps.items()}
            out[name]["late_bytes"] = {v: _bytes_per_step(f, 3) for v, f in losses.late.items()}
            out[name]["trace"] = losses.trace(steps)
        del steps, losses
    return out


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


# [Note: where a step's time goes on a CPU machine]
# Work placed "during" communication is faster only if the communication leaves a core
# idle. On gloo over loopback a reduction is CPU work itself (copies and sums on gloo's
# threads), so the figure that says whether overlap can pay is how busy the cores are:
# the CPU seconds of every rank (all threads) per wall second of the step. Near the
# core count, the machine is saturated and a step takes as long as its total CPU work,
# wherever that work sits; then the CPU-time ratio, not the overlap, decides the wall
# ratio. Well under it, waiting is exposed and overlap can hide it.
def _cpu_figures(per_rank: list[dict[str, Any]], wall: dict[str, list[float]]) -> dict[str, float]:
    """``busy_*``: cores busy per variant (all ranks' CPU seconds / the slowest rank's
    wall seconds, medians); ``cpu_ratio``: cadence's CPU time over torch's."""
    cpu = {
        k: [sum(c) for c in zip(*(r["cpu"][k] for r in per_rank), strict=True)]
        for k in ("plain", "cadence", "torch")
    }
    figures = {f"busy_{k}": _median(cpu[k]) / _median(wall[k]) for k in cpu}
    figures["cpu_ratio"] = _median(cpu["cadence"]) / _median(cpu["torch"])
    return figures


# [Note: a case on a link carries more compute per byte]
# On a cluster the reductions run on the NIC and the GPU's copy engines, and the host's
# cores stay free for the step. Here gloo's copies through TCP and its sums are CPU
# work on the same two cores as the compute: about 0.35 of dense AdamW's compute per
# step at batch 128, whatever the rate. At the calibrated rate (wire time = backward)
# that CPU, not the wire, set the step in the record of 2026-12-06 (all ranks' CPU
# seconds over the cores reached 1.4 C against a serial C + wire of 1.5 C), so no
# timing could show. Four times the batch on a link keeps the bytes per step and
# quadruples the compute, so the calibrated rate falls by four and gloo's CPU share of
# a step by about as much: the wire, as on a cluster, becomes what overlap must hide.
# Unshaped runs keep the batch of their record.
LINK_BATCH_SCALE = 4


def on_link(spec: dict[str, Any]) -> dict[str, Any]:
    """A case's spec as it runs on an emulated link: see the note above."""
    batch = spec["batch"] * LINK_BATCH_SCALE
    return dict(spec, batch=batch, what=f"{spec['what']} (batch x{LINK_BATCH_SCALE} on a link)")


def _reps(quick: bool, tiny: bool) -> tuple[int, int]:
    """(warmup, reps); ``CADENCE_BENCH_REPS=W,R`` overrides them (the calibration pass
    of ``--link calibrated`` needs only a few steps)."""
    raw = os.environ.get("CADENCE_BENCH_REPS")
    if raw:
        w, r = (int(v) for v in raw.split(","))
        return w, r
    return (1, 2) if tiny else (3, 12) if quick else (5, 40)


def _select(cases: dict[str, dict[str, Any]], names: list[str] | None) -> dict[str, dict[str, Any]]:
    if names is None:
        return cases
    unknown = [n for n in names if n not in cases]
    if unknown or not names:
        raise CadenceValueError(
            f"unknown step case(s) {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(cases)}"
        )
    return {n: cases[n] for n in names}


def run(
    *, quick: bool, tiny: bool = False, world: int = 2, cases: list[str] | None = None
) -> dict[str, Any]:
    """Run the comparison and return its record (not yet written)."""
    from cadence.bench import step
    from cadence.link import active_link

    link = active_link()
    chosen = _select(TINY if tiny else CASES, cases)
    if link is not None and not tiny:
        chosen = {name: on_link(spec) for name, spec in chosen.items()}
    warmup, reps = _reps(quick, tiny)
    load0 = loadavg()
    # See [Note: a case with its own world].
    worlds: dict[int, dict[str, dict[str, Any]]] = {}
    for name, spec in chosen.items():
        worlds.setdefault(spec.get("world", world), {})[name] = spec
    results: dict[str, list[dict[str, Any]]] = {}
    for w, group in worlds.items():
        per_rank = launch_ranks(step.rank_body, group, warmup, reps, world=w, timeout=1800)
        for name in group:
            results[name] = [r[name] for r in per_rank]
    rows = []
    for name, spec in chosen.items():
        ran = list(results[name][0]["times"])
        t = {k: slowest_per_rep([r["times"] for r in results[name]], k) for k in ran}
        plain = _median(t["plain"])
        extra = {f"limit_{k}": _median(t[k]) / plain for k in ("cadence", "cadence_sync", "torch")}
        extra.update(_cpu_figures(results[name], t))
        row = timed_row(name, t, mine="cadence", ref="torch", ref_b="torch_b",
                        target=spec["target"], what=spec["what"], extra=extra)  # fmt: skip
        # The first rank that computed a loss in every variant (a pipeline's first
        # stage computes none).
        row["losses"] = next(
            (r["losses"] for r in results[name] if len(r["losses"]) == len(ran)), None
        )
        if TORCH_BEST in t:
            row["ratio_best"] = ratio_summary(paired_ratios(t["cadence"], t[TORCH_BEST]))
        if link is not None:
            row["link"] = link_figures(spec["kind"], results[name], t, link)
            row["trace"] = results[name][0]["trace"]
        rows.append(row)
    settings: dict[str, Any] = {"world": world, "backend": device_and_backend(world)[1]}
    for w, group in worlds.items():
        if w != world:
            settings[f"world_{w}"] = f"{', '.join(group)} ({device_and_backend(w)[1]})"
    settings.update({"warmup": warmup, "reps": reps, "bucket_cap_mb": BUCKET_CAP_MB,
                     "threads_per_rank": 1})  # fmt: skip
    return make_record("step", quick=quick, rows=rows, load_before=load0, settings=settings)


def timeline_path(record_png: Path, case: str) -> Path:
    """Where a case's timeline picture goes, beside its record's chart."""
    return record_png.with_name(f"{record_png.stem}-{case}-timeline.png")


def write_chart(record: dict[str, Any], path: Path) -> Path | None:
    """The record's ratio chart, and on a link one timeline picture per case."""
    from cadence.bench._record import write_chart as ratio_chart
    from cadence.bench._timeline import write_timeline

    for row in record["rows"]:
        if "trace" in row:
            rate = record["settings"].get("link_rate_measured_bps") or 0
            title = f"{row['case']} on a {rate / 1e9:.3g} Gbit/s link: one traced step per variant"
            write_timeline(row, timeline_path(path, row["case"]), title)
    return ratio_chart(record, path)
