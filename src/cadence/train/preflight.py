"""What this machine must give a ``cadence train`` run, checked before any rank starts.

`TrainConfig` checks what a run *is*, the same anywhere (no file system, no machine).
A valid run can still be impossible here: its ``--run-dir`` is a file, or it needs
more memory than the machine has. Found inside the ranks, the first fails only after
the whole run trained (the folder is made at the end), and the second fails in
every rank with an allocation error or the kernel's OOM killer; `preflight` refuses
both up front, with the flags to change. Torch-free, and it only reads.

[Note: the memory a run needs, at least]
``cadence train`` computes on the CPU, so every byte below is this machine's memory.
The estimate is a lower bound, so that a run it refuses cannot fit, and one it
passes may still not:

- the model: every rank builds the whole TinyGPT (fp32) before it shards or splits
  it; in training each replica holds parameters, gradients and AdamW's two moments
  (16 bytes a parameter), a `fully_shard` group one copy across its ranks;
- activations: what autograd keeps of one microbatch per stage, (7 + 2 x mlp_ratio)
  x d_model floats a token and block (the two LayerNorm outputs, q/k/v, the attention
  output, the residual, the MLP's hidden layer before and after GELU) plus the
  logits;
- the data: each rank's Markov chain (two vocab x vocab float tables) and a step's
  rows of it (global batch x vocab); with ``--data``, a step's global batch of int64
  windows (the corpus itself is memory-mapped, or counted by the file system);
- the ranks: 100 MiB for each rank's interpreter with torch imported (measured near
  300 MiB; 100 keeps the bound a bound).

The limit is the machine's physical memory (``os.sysconf``); where that is unknown,
1 TiB. Absurd sizes (a typo's extra zeros) exceed either by orders of magnitude.

[Note: a node that rejoins under torchrun]
With ``--max-restarts`` above 0 across nodes, torchrun restarts every worker when one
node fails, and a node that comes back must rendezvous again. By default the agents
share the rendezvous's TCP store with their workers (``TORCHELASTIC_USE_AGENT_STORE``
is True in a worker's environment); then the returning agent waits for a key the
surviving rank-0 agent never publishes again, and every agent exits with
``DistStoreError: wait timeout ... MASTER_ADDR`` before any worker starts (torch 2.13
to 2.15, a plain DDP script alike). With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in
each agent's environment the node rejoins and the run resumes from its checkpoint.
A worker cannot change its agent's settings, so `preflight` refuses such a run at its
start, naming the variable, rather than letting it fail at the first fault.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from cadence.train._errors import TrainConfigError
from cadence.train.config import TrainConfig

__all__ = ["memory_needed", "preflight", "torchrun_rejoin_problem"]

_RANK_BYTES = 100 * 2**20
_UNKNOWN_MEMORY = 2**40
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def preflight(cfg: TrainConfig) -> None:
    """Refuse (`TrainConfigError`) a run this machine cannot give what it needs: a
    usable ``--run-dir``, the memory of [Note: the memory a run needs, at least], and
    ``--data`` that exists and fits the model (`cadence.train.data.corpus`)."""
    _check_run_dir_path(cfg.run_dir)
    _check_memory(cfg)
    problem = torchrun_rejoin_problem(os.environ)
    if problem:
        raise TrainConfigError(problem)
    if cfg.data:
        # Imported here: numpy and the file walk only for a run that reads data.
        from cadence.train.data.corpus import check_corpus

        check_corpus(cfg, cfg.world_size)


def torchrun_rejoin_problem(env: Mapping[str, str]) -> str | None:
    """Why a node of this torchrun job could not rejoin after a fault, or None.

    See [Note: a node that rejoins under torchrun]; ``env`` is a worker's environment.
    """
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        nodes = int(env.get("GROUP_WORLD_SIZE", "1"))
    except ValueError:
        return None  # not torchrun's values: nothing to say about its rendezvous
    if restarts > 0 and nodes > 1 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (
            f"torchrun runs {nodes} nodes with --max-restarts {restarts}, but its agents "
            "share their rendezvous store, so a node that fails and comes back cannot "
            "rejoin (its agent waits for a key that is never written again); start every "
            "agent with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (see "
            "docs/multinode.md), or run with --max-restarts 0"
        )
    return None


def _check_run_dir_path(run_dir: str) -> None:
    # "" is the default runs/<timestamp>, made under ./runs.
    flag = f"--run-dir {run_dir!r}" if run_dir else "the default --run-dir runs/<timestamp>"
    path = Path(run_dir or "runs")
    try:
        if path.is_symlink() and not path.exists():
            raise TrainConfigError(
                f"{flag} is a symbolic link to nothing ({os.readlink(path)!r}): make its "
                "target folder, or give another --run-dir"
            )
        if path.exists():
            if not path.is_dir():
                raise TrainConfigError(
                    f"{flag} is a file, not a folder: the run writes metrics.json, "
                    "config.toml and its checkpoints into it; give a folder, new or existing"
                )
            nearest = path
        else:
            nearest = next((p for p in path.parents if p.exists()), Path.cwd())
            if not nearest.is_dir():
                raise TrainConfigError(
                    f"{flag} lies under the file {str(nearest)!r}, so the folder cannot be "
                    "made; give a path under a folder"
                )
    except OSError as exc:  # e.g. a name longer than the file system takes
        raise TrainConfigError(f"{flag} cannot be used: {exc.strerror}; give another") from exc
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise TrainConfigError(
            f"{flag}: this user cannot write in {str(nearest)!r}; give a folder you can write"
        )


def memory_needed(cfg: TrainConfig, *, local_ranks: int, world: int) -> dict[str, int]:
    """At least how many bytes ``cfg`` needs on a machine that runs ``local_ranks`` of
    its ``world`` ranks, by part. See [Note: the memory a run needs, at least]."""
    m = cfg.model
    d, layers, vocab, seq, ratio = m.d_model, m.n_layers, m.vocab_size, m.seq_len, m.mlp_ratio
    params = (
        vocab * d * (1 if m.tie_embeddings else 2)
        + seq * d
        + layers * ((4 + 2 * ratio) * d * d + (9 + ratio) * d)
        + 2 * d
    )
    layout = cfg.layout(world)
    copies = layout.dp_replicate if layout.wrapper == "fully_shard" else layout.dp
    model = max(4 * params * local_ranks, 16 * params * copies * local_ranks // world)
    rows = cfg.batch_size // layout.microbatches  # one microbatch, over all replicas
    activations = 4 * rows * seq * (layers * (7 + 2 * ratio) * d + vocab) * local_ranks // world
    if cfg.data:
        data = local_ranks * 8 * cfg.batch_size * (seq + 1)
    else:
        data = local_ranks * 4 * (2 * vocab * vocab + cfg.batch_size * vocab)
    return {
        "the model": model,
        "activations": activations,
        "the data": data,
        "the ranks": local_ranks * _RANK_BYTES,
    }


def _machine_memory() -> int:
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not POSIX, or not reported
        return _UNKNOWN_MEMORY
    return pages * page if pages > 0 and page > 0 else _UNKNOWN_MEMORY


def _check_memory(cfg: TrainConfig) -> None:
    world = cfg.world_size
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_torchrun else world
    need = memory_needed(cfg, local_ranks=local, world=world)
    have = _machine_memory()
    total = sum(need.values())
    if total <= have:
        return
    m = cfg.model
    ranks_from = "torchrun's --nproc-per-node" if under_torchrun else f"--nproc {local}"
    causes = {
        "the model": f"--d-model {m.d_model}, --layers {m.n_layers}",
        "activations": f"--batch-size {cfg.batch_size}, --d-model {m.d_model}, "
        f"--layers {m.n_layers}",
        "the data": f"--vocab-size {m.vocab_size}, --batch-size {cfg.batch_size}",
        "the ranks": f"{local} ranks here, {ranks_from}",
    }
    parts = sorted(need, key=need.__getitem__, reverse=True)
    detail = "; ".join(f"{part} {_size(need[part])} ({causes[part]})" for part in parts)
    raise TrainConfigError(
        f"this run needs at least {_size(total)} of memory on this machine, which has "
        f"{_size(have)}: {detail}; use a smaller value for the flags of the largest part"
    )


def _size(n: int) -> str:
    # Integer arithmetic: an absurd size can be past the largest float.
    for i, unit in enumerate(_UNITS[:-1]):
        if n < 1024 ** (i + 1):
            return f"{n / 1024**i:.1f} {unit}"
    return f"{n // 1024 ** (len(_UNITS) - 1):,} {_UNITS[-1]}"
