"""``cadence train`` end to end: launch the ranks, run each, report on rank 0.

Runs on ``--nproc`` local ranks (spawned with `cadence.launch`), or on the ranks
torchrun started (when ``RANK``/``WORLD_SIZE`` are set).

[Note: reports go to rank 0]
Only rank 0 reports, so the per-rank reports (precompile's sources and seconds, the
timeline) are gathered to rank 0 alone, as JSON (`Comm.gather_bytes`): a rank other
than 0 sends its own report and receives nothing, whatever the world size, and no
rank unpickles what a peer sent. Each timeline is capped (`capped_timeline`: the
last steps, at most `TIMELINE_MAX_EVENTS` communication events), so rank 0 holds
at most world x that bound. The other ranks return None for both (a launch sends
every rank's return value to the parent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cadence._groups.dist_init import init
from cadence.comm import Comm
from cadence.launch import launch
from cadence.train.build import build_state, topology_for
from cadence.train.checkpoint import (
    Checkpointer,
    check_run_dir,
    checkpoint_dir,
    delete_checkpoints,
    load_checkpoint,
)
from cadence.train.config import TrainConfig
from cadence.train.export import export_weights
from cadence.train.history import RunHistory
from cadence.train.log import console, logger
from cadence.train.loop import run_loop
from cadence.train.metrics import flop_params, peak_memory_bytes
from cadence.train.placement import torchrun_placement
from cadence.train.plots import (
    TIMELINE_MAX_EVENTS,
    TIMELINE_STEPS,
    TimelineEvent,
    capped_timeline,
    write_plots,
)
from cadence.train.report import (
    Progress,
    print_samples,
    print_table,
    summarize,
    write_config,
    write_metrics,
)
from cadence.train.sample import sample_text

__all__ = ["run_rank", "train"]


def run_rank(cfg: TrainConfig) -> dict[str, Any]:
    """One rank's whole run (called in each spawned rank, or directly under torchrun)."""
    console()  # a spawned rank starts with nothing configured: see the note in log.py
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, cfg.nproc)))
    # Validated for the real world size before the first collective (init).
    layout = cfg.layout()
    pg = init(topology_for(layout), timeout=cfg.collective_timeout)
    if pg.rank == 0:
        described = torchrun_placement(layout, os.environ)
        if described is not None:
            line, warning = described
            logger.info("%s", line)
            if warning:
                logger.warning("%s", warning)
    state = build_state(cfg, pg)
    if cfg.data and pg.rank == 0:
        corpus = state.data.corpus  # type: ignore[union-attr]  # cfg.data: state.data is a TokenWindows
        logger.info(
            "data: %s: %s training tokens, %s held out",
            corpus.what,
            f"{len(corpus.train):,}",
            f"{len(corpus.val):,}",
        )
    history = RunHistory()
    if cfg.resume:
        history, note = load_checkpoint(cfg, state)
        if pg.rank == 0:
            logger.info("%s", note)
    reports = Comm(None, name="report")  # see [Note: reports go to rank 0]
    compiled: list[Any] | None = None
    if cfg.compile:
        from cadence.train.compile import compile_state  # imports the precompile stack

        compiled = _to_rank0(reports, compile_state(cfg, state))
    # Closed on every path, in reverse (an error in a step included): a save in flight
    # is waited and its group freed before the caller destroys the default group.
    with contextlib.ExitStack() as closing:
        saver = Checkpointer(cfg, state) if cfg.checkpoint_every else None
        if saver is not None:
            closing.callback(saver.close)
        bar = Progress(cfg.steps, state.step) if pg.rank == 0 else None
        if bar is not None:
            closing.callback(bar.close)
        board = _tensorboard(cfg, state.step) if cfg.tensorboard and pg.rank == 0 else None
        if board is not None:
            closing.callback(board.close)

        def on_step(step: int, loss: float) -> None:
            history.losses.append(loss)
            if bar is not None:
                bar(step, loss)
            if board is not None:
                board.add_scalar("loss", loss, step + 1)
            if saver is not None:
                saver.after_step(history)

        def on_eval(step: int, loss: float) -> None:
            history.evals.append((step + 1, loss))
            if pg.rank == 0:
                logger.info("eval after step %d: loss %.4f", step + 1, loss)
            if board is not None:
                board.add_scalar("eval_loss", loss, step + 1)

        result = run_loop(
            state,
            max(0, cfg.steps - state.step),
            cfg.batch_size,
            on_step,
            eval_every=cfg.eval_every,
            eval_batches=cfg.eval_batches,
            on_eval=on_eval,
        )
    if cfg.export:
        assert state.export_plan is not None  # build_state makes it with --export
        path = export_weights(state.export_plan, state.modules, pg, cfg.export)
        if path is not None:
            logger.info("exported the weights to %s", path)
    # Collective on every rank: see [Note: samples are generated in lockstep].
    samples = sample_text(cfg, state) if cfg.sample_tokens else None
    n_params = torch.tensor([flop_params(state.modules)], dtype=torch.int64)
    if layout.pp > 1:  # each pipeline position counts its own stages
        Comm(pg.pp, name="pp-params").all_reduce(n_params, op="sum")
    memory, memory_kind = peak_memory_bytes(pg.device)
    log = state.event_log
    events, dropped = capped_timeline(log)
    sent = _to_rank0(reports, {"events": events, "dropped": dropped, "memory": memory})
    reduced = layout.wrapper != "none"
    out: dict[str, Any] = {
        "losses": history.losses,
        "evals": history.evals,
        "history": history,
        "step_time_median_s": result.step_time_median_s,
        "comm_exposed_s": log.total_wait_time("all_reduce", "reduce_scatter")
        if reduced
        else float("nan"),
        "comm_hidden_s": log.total_in_flight_time("all_reduce", "reduce_scatter")
        if reduced
        else float("nan"),
        "collectives": log.total_counts(),
        "flop_params": int(n_params.item()),
        "peak_memory_bytes": None if sent is None else [r["memory"] for r in sent],
        "peak_memory_kind": memory_kind,
        "samples": samples,
        "timeline": None if sent is None else [_events(r["events"]) for r in sent],
        "timeline_bounds": None
        if sent is None
        else {
            "steps_per_rank": TIMELINE_STEPS,
            "max_events_per_rank": TIMELINE_MAX_EVENTS,
            "dropped_events_per_rank": [r["dropped"] for r in sent],
        },
    }
    if cfg.compile:
        out["precompile"] = compiled
    if layout.pp > 1:
        out["pipeline"] = {
            "first_loss": history.losses[0],
            "final_loss": history.losses[-1],
            "steps": cfg.steps,
            "step_time_median_s": result.step_time_median_s,
            "schedule": layout.schedule,
            "pp": layout.pp,
            "dp": layout.dp,
            "chunks": layout.chunks,
            "n_microbatches": layout.microbatches,
            "wrapper": layout.wrapper,
        }
    return out


def _to_rank0(comm: Comm, report: Any) -> list[Any] | None:
    """Every rank's JSON-able ``report`` on rank 0, in rank order; None on the others."""
    got = comm.gather_bytes(json.dumps(report).encode(), dst=0)
    return None if got is None else [json.loads(raw) for raw in got]


def _events(rows: list[list[Any]]) -> list[TimelineEvent]:
    return [(str(k), str(g), float(t), w0, w1) for k, g, t, w0, w1 in rows]


def _timeline_note(bounds: dict[str, Any]) -> str:
    """What the timeline picture leaves out, for its title."""
    note = (
        f"last {bounds['steps_per_rank']} steps per rank, at most "
        f"{bounds['max_events_per_rank']} communication events each"
    )
    dropped = {r: n for r, n in enumerate(bounds["dropped_events_per_rank"]) if n}
    if dropped:
        note += "; earlier events dropped: " + ", ".join(
            f"rank {r}: {n}" for r, n in dropped.items()
        )
    return note


def _run_torchrun_rank(cfg: TrainConfig) -> dict[str, Any]:
    """`run_rank` in a process torchrun started, leaving the process group it made.

    [Note: a torchrun rank leaves its process group before it exits]
    `cadence.launch` ends each rank with ``destroy_process_group`` and ``os._exit``;
    under torchrun the rank returns through the interpreter's shutdown instead. Left
    to that shutdown, the gloo group, its pairs and the store client are torn down in
    whatever order the garbage collector picks, while the peers (and rank 0's attempt
    store) exit at their own pace, and a rank of a restarted attempt was seen to abort
    there ("terminate called without an active exception", exit -6) after a run that
    had finished. So the group this call made is destroyed here, on every path; a
    group the caller made before calling `train` is the caller's to destroy.
    """
    made_here = not dist.is_initialized()
    try:
        return run_rank(cfg)
    finally:
        if made_here and dist.is_initialized():
            dist.destroy_process_group()


def _tensorboard(cfg: TrainConfig, start: int) -> Any:
    """Rank 0's TensorBoard writer. After a resume, ``purge_step`` drops the points a
    lost attempt logged past the checkpoint, so the curve has one point per step."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(
        log_dir=str(Path(cfg.run_dir) / "tensorboard"), purge_step=start + 1 if start else None
    )


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cadence train``; rank 0 writes ``metrics.json``, ``config.toml``, the
    plots, and returns the summary."""
    console()
    # Resolved before the launch, so the launched ranks share it. (Under torchrun each
    # process resolves its own; only rank 0 writes, and checkpoints need --run-dir.)
    if not cfg.run_dir:
        cfg = dataclasses.replace(cfg, run_dir=f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    layout = cfg.layout()
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    # Before any rank starts: a run that would mix with the checkpoints in its folder
    # is refused here, once, rather than on every rank after the launch.
    check_run_dir(cfg)
    # Under torchrun, rank 0 deletes: no rank writes a checkpoint before every rank has
    # joined the process group, so the others cannot race it.
    if cfg.overwrite and (not under_torchrun or int(os.environ["RANK"]) == 0):
        deleted = delete_checkpoints(cfg.run_dir)
        if deleted:
            logger.info(
                "--overwrite deleted the checkpoints of an earlier run (%s) in %s",
                ", ".join(deleted),
                checkpoint_dir(cfg.run_dir),
            )
    if under_torchrun:
        result = _run_torchrun_rank(cfg)
        if int(os.environ["RANK"]) != 0:
            return {}
    else:
        # run_rank initialises the process group itself, with --collective-timeout.
        result = launch(
            run_rank, cfg, nprocs=cfg.nproc, timeout=cfg.timeout, init_process_group=False
        )[0]
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(cfg, layout, result)
    write_metrics(cfg, summary, result, run_dir)
    write_config(cfg, run_dir)
    if result.get("samples") is not None:
        (run_dir / "samples.txt").write_text(result["samples"], encoding="utf-8")
        print_samples(result["samples"])
    plots = write_plots(
        run_dir, result["history"], result["timeline"], _timeline_note(result["timeline_bounds"])
    )
    if isinstance(plots, str):
        logger.warning("%s", plots)
    print_table(summary, run_dir, result.get("precompile"))
    return summary
