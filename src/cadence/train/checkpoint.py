"""Checkpoints of a ``cadence train`` run, through ``torch.distributed.checkpoint`` (DCP).

A checkpoint is the folder ``<run_dir>/checkpoints/step-<N>/`` holding, after step N:

- ``model`` and ``optim``: DCP's model and optimizer state dicts
  (``get_state_dict``), so fully_shard parameters and their AdamW moments are saved
  as shards and resharded on load; DataParallel replicas save one copy; each
  pipeline rank saves its own stages (keyed ``stage<s>``) and its own optimizer
  (``optim_pp<p>``);
- ``history``: the `RunHistory` (every loss so far, checkpoints, restarts), which is
  also the data position: step ``N + 1`` reads global batch ``N``;
- ``rng/rank<r>``: every rank's RNG states (torch, CUDA, ``random``, numpy);
- ``cadence.json``: the manifest, written last (see the note).

[Note: a checkpoint counts only once complete]
Every rank writes into ``.step-<N>.tmp``. DCP's save ends with rank 0 writing
``.metadata`` after every rank has reported its writes, so when the save returns on
rank 0 all the data is on disk. Rank 0 then writes the manifest (each file's size)
and renames the folder to ``step-<N>``: a rename is atomic, so a ``step-<N>`` folder
is never half written. A job killed mid-save leaves a ``.tmp`` folder, which the
next run deletes. A ``step-<N>`` folder that fails the manifest check (a file
missing or of another size, e.g. a copy cut short) is skipped on resume, and the
skip is reported: resume takes the newest complete checkpoint. The folder must be
on a filesystem every rank sees (one machine, or a shared filesystem across nodes).
"""

from __future__ import annotations

import json
import pickle
import random
import re
import shutil
import sys
import threading
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from cadence.errors import CadenceError
from cadence.train.build import TrainState
from cadence.train.config import TrainConfig
from cadence.train.history import RunHistory

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "ResumeRefusedError",
    "find_latest",
    "load_checkpoint",
]

MANIFEST = "cadence.json"
_STEP = re.compile(r"^step-(\d+)$")
# The flags a checkpoint's numbers depend on: a resume under other values would
# silently continue another run, so it is refused (see `_check_compatible`).
_MUST_MATCH = ("batch_size", "lr", "seed", "fsdp", "mixed_precision", "pp", "model")


class CheckpointError(CadenceError, RuntimeError):
    """A checkpoint could not be written."""


class ResumeRefusedError(CadenceError, ValueError):
    """``--resume`` found a checkpoint this run cannot continue from."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _stateful_root(state: TrainState) -> nn.Module:
    """The module whose state dict is saved: the wrapped model, or this rank's stages
    keyed by stage index (so each pipeline rank saves and loads its own part)."""
    if state.runtime is None:
        assert state.model is not None
        return state.model
    return nn.ModuleDict(
        {f"stage{s}": state.runtime.stages[s].module for s in state.runtime.stages}
    )


def _optim_key(state: TrainState) -> str:
    """Pipeline ranks hold different optimizers whose param groups share key names:
    each pipeline position saves its own under its own key (replicas of one position
    hold equal ones, which DCP saves once)."""
    return "optim" if state.runtime is None else f"optim_pp{state.groups.pp_rank}"


def _rng_states() -> bytes:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        states["numpy"] = sys.modules["numpy"].random.get_state()
    return pickle.dumps(states)


def _set_rng_states(blob: bytes) -> None:
    states = pickle.loads(blob)
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy

        numpy.random.set_state(states["numpy"])


def _manifest(cfg: TrainConfig, state: TrainState, step: int, folder: Path) -> dict[str, Any]:
    layout = state.layout
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    return {
        "step": step,
        "world_size": layout.world,
        "layout": {
            "pp": layout.pp,
            "dp": layout.dp,
            "wrapper": layout.wrapper,
            "schedule": layout.schedule,
            "chunks": layout.chunks,
            "microbatches": layout.microbatches,
        },
        "config": {k: v for k, v in asdict(cfg).items() if k in _MUST_MATCH},
        "files": files,
    }


def _why_incomplete(folder: Path) -> str | None:
    """None when ``folder`` is a complete checkpoint, else why it is not."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (its save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as exc:
        return f"unreadable {MANIFEST}: {exc}"
    if ".metadata" not in files:
        return "the manifest lists no DCP .metadata"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
    return None


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name))]
    return sorted(found)


def find_latest(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint in ``run_dir`` (or None), and a line per newer
    folder that was skipped, saying why. See [Note: a checkpoint counts only once complete]."""
    root = checkpoint_dir(run_dir)
    skipped = [f"{p.name}: an unfinished save" for p in sorted(root.glob(".step-*.tmp"))]
    for _, folder in reversed(_step_folders(root)):
        why = _why_incomplete(folder)
        if why is None:
            return folder, skipped
        skipped.append(f"{folder.name}: {why}")
    return None, skipped


def _check_compatible(cfg: TrainConfig, state: TrainState, manifest: dict[str, Any]) -> None:
    """Refuse, on every rank alike, a checkpoint this run cannot continue exactly."""
    saved = manifest["config"]
    now = {k: v for k, v in asdict(cfg).items() if k in _MUST_MATCH}
    differ = [k for k in _MUST_MATCH if saved.get(k) != now[k]]
    layout = state.layout
    for key in ("schedule", "chunks", "microbatches", "wrapper"):
        if manifest["layout"][key] != getattr(layout, key):
            differ.append(key)
    if differ:
        detail = ", ".join(
            f"{k}: saved {manifest['layout'].get(k, saved.get(k))!r}, now "
            f"{getattr(layout, k) if k in manifest['layout'] else now[k]!r}"
            for k in differ
        )
        raise ResumeRefusedError(
            f"the checkpoint was written by a run with other settings ({detail}); resume "
            "with the same flags, or use another --run-dir to start a new run"
        )
    old = manifest["world_size"]
    if old != layout.world and layout.wrapper != "fully_shard":
        raise ResumeRefusedError(
            f"the checkpoint was saved by {old} ranks and this run has {layout.world}: only "
            f"--fsdp checkpoints are resharded on load, and this run wraps with "
            f"{layout.wrapper}. Resume on {old} ranks (pipeline stages and replicated "
            "states are saved per rank layout)"
        )


def load_checkpoint(cfg: TrainConfig, state: TrainState) -> tuple[RunHistory, str]:
    """Load the newest complete checkpoint of ``cfg.run_dir`` into ``state``.

    Collective: rank 0 picks the folder and every rank loads that one. Returns the
    restored history (empty when there is no checkpoint: a fresh start) and a line
    saying what was loaded and what was skipped. Raises `ResumeRefusedError` on every
    rank alike when the checkpoint belongs to another kind of run.
    """
    choice: list[Any] = [None]
    if dist.get_rank() == 0:
        folder, skipped = find_latest(cfg.run_dir)
        manifest = json.loads((folder / MANIFEST).read_text()) if folder else None
        choice = [(str(folder) if folder else None, manifest, skipped)]
    dist.broadcast_object_list(choice, src=0)
    folder_s, manifest, skipped = choice[0]
    notes = [f"skipped {line}" for line in skipped]
    if folder_s is None:
        return RunHistory(), "; ".join(
            [f"no complete checkpoint in {cfg.run_dir}: fresh start", *notes]
        )
    _check_compatible(cfg, state, manifest)
    root = _stateful_root(state)
    model_sd, optim_sd = get_state_dict(root, state.optimizer)
    rank = dist.get_rank()
    okey = _optim_key(state)
    sd: dict[str, Any] = {"model": model_sd, okey: optim_sd, "history": ""}
    # Ranks that did not exist when it was saved keep their fresh RNG streams.
    if rank < manifest["world_size"]:
        sd[f"rng/rank{rank}"] = b""
    dcp.load(sd, checkpoint_id=folder_s)
    set_state_dict(root, state.optimizer, model_state_dict=sd["model"], optim_state_dict=sd[okey])
    if isinstance(sd.get(f"rng/rank{rank}"), bytes) and sd[f"rng/rank{rank}"]:
        _set_rng_states(sd[f"rng/rank{rank}"])
    history = RunHistory.from_json(sd["history"])
    step = manifest["step"]
    if history.step != step:
        raise CheckpointError(
            f"{folder_s}: its history has {history.step} steps, its manifest {step}"
        )
    state.step = step
    history.resumes.append(step)
    return history, "; ".join([f"resumed from {Path(folder_s).name} (step {step})", *notes])


class Checkpointer:
    """Writes a checkpoint every ``cfg.checkpoint_every`` steps and after the last one.

    Collective: every rank calls `after_step` after every step and `close` at the
    end. With ``cfg.async_checkpoint`` the write runs on a background thread over
    its own gloo group (so it never interleaves with the training collectives),
    and a save waits for the previous one first.
    """

    def __init__(self, cfg: TrainConfig, state: TrainState) -> None:
        self.cfg = cfg
        self.state = state
        self.root = checkpoint_dir(cfg.run_dir)
        self.rank = dist.get_rank()
        self._pending: Future | None = None
        self._committed = threading.Event()
        self._failed: BaseException | None = None
        self._group = dist.new_group(backend="gloo") if cfg.async_checkpoint else None
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            # Leftovers of a save that a crash cut short. No rank writes before rank 0
            # joins the first save's planning collective, so this runs before them.
            for stale in self.root.glob(".step-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)

    def after_step(self, history: RunHistory) -> None:
        step = history.step
        if step % self.cfg.checkpoint_every == 0 or step == self.cfg.steps:
            self.save(history)

    def save(self, history: RunHistory) -> None:
        self.wait()
        step = history.step
        history.checkpoints.append(step)
        model_sd, optim_sd = get_state_dict(_stateful_root(self.state), self.state.optimizer)
        sd = {
            "model": model_sd,
            _optim_key(self.state): optim_sd,
            "history": history.to_json(),
            f"rng/rank{self.rank}": _rng_states(),
        }
        tmp = self.root / f".step-{step}.tmp"
        if self._group is None:
            dcp.save(sd, checkpoint_id=tmp)
            self._commit(tmp, step)
            return
        fut = dcp.async_save(sd, checkpoint_id=tmp, process_group=self._group)
        assert isinstance(fut, Future)
        self._committed.clear()
        fut.add_done_callback(lambda f: self._on_done(f, tmp, step))
        self._pending = fut

    def _on_done(self, fut: Future, tmp: Path, step: int) -> None:
        # On the save's thread: filesystem work only, no collectives.
        try:
            fut.result()
            self._commit(tmp, step)
        except BaseException as exc:  # raised again by `wait` on the main thread
            self._failed = exc
        finally:
            self._committed.set()

    def _commit(self, tmp: Path, step: int) -> None:
        """Rank 0: manifest, then the atomic rename, then prune to ``--keep``."""
        if self.rank != 0:
            return
        manifest = _manifest(self.cfg, self.state, step, tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        final = self.root / f"step-{step}"
        if final.exists():  # an older, incomplete save of the same step
            shutil.rmtree(final)
        tmp.rename(final)
        if self.cfg.keep:
            complete = [s for s, p in _step_folders(self.root) if _why_incomplete(p) is None]
            if len(complete) > self.cfg.keep:
                oldest_kept = complete[-self.cfg.keep]
                for s, p in _step_folders(self.root):
                    if s < oldest_kept:
                        shutil.rmtree(p, ignore_errors=True)

    def wait(self) -> None:
        """Block until the background save (if any) is written and committed."""
        if self._pending is not None:
            # Not fut.result(): the callback (the commit) may still run after it returns.
            self._committed.wait()
            self._pending = None
        if self._failed is not None:
            exc, self._failed = self._failed, None
            raise CheckpointError(f"the background checkpoint save failed: {exc}") from exc

    def close(self) -> None:
        self.wait()
