"""Checkpoints of a ``cadence train`` run, through ``torch.distributed.checkpoint`` (DCP).

A checkpoint is the folder ``<run_dir>/checkpoints/step-<N>/`` holding, after step N:

- ``model`` and ``optim``: DCP's model and optimizer state dicts
  (``get_state_dict``), so fully_shard parameters and their AdamW moments are saved
  as shards and resharded on load; DataParallel replicas save one copy; each
  pipeline rank saves its own stages (keyed ``stage<s>``) and its own optimizer
  (``optim_pp<p>``);
- ``lr_schedule/<optim key>/*``: the learning-rate schedule's step and base rates
  (`cadence.train.lr_schedule`), beside the optimizer it schedules;
- ``rng/rank<r>/*``: every rank's RNG states (torch, CUDA, ``random``, numpy) as
  uint8 tensors and JSON (`cadence.train._rng`);
- ``history.json``: the `RunHistory` (every loss so far, checkpoints, restarts), which
  is also the data position: step ``N + 1`` reads global batch ``N``;
- ``cadence.json``: the manifest, written last: every other file's size and sha256,
  signed (`cadence.train._manifest`).

[Note: a checkpoint counts only once complete]
Every rank writes into ``.step-<N>.tmp``. DCP's save ends with rank 0 writing
``.metadata`` after every rank has reported its writes, so when the save returns on
rank 0 all the data is on disk. Rank 0 then writes ``history.json`` and the manifest
and renames the folder to ``step-<N>``: a rename is atomic, so a ``step-<N>`` folder
is never half written. A job killed mid-save leaves a ``.tmp`` folder, which the
next run deletes. A ``step-<N>`` folder that fails the manifest's size check (a file
missing or of another size, e.g. a copy cut short) is skipped on resume, and the
skip is reported: resume takes the newest complete checkpoint, then verifies it in
full (next note). The folder must be on a filesystem every rank sees (one machine,
or a shared filesystem across nodes).
A folder is a checkpoint only if its whole name is ``step-<N>``, N in ASCII digits
without a leading zero (the name `_commit` writes): ``\\d`` would also take
``step-`` with Arabic-Indic digits and ``$`` a name with a trailing newline, so names
are matched with ``re.fullmatch`` on ``[0-9]``; other ``step-*`` names are ignored,
and reported as skipped.

[Note: a checkpoint is verified before anything in it is unpickled]
A checkpoint is data from disk, and DCP deserializes parts of it with pickle, which
runs whatever code the bytes name. So resume reads nothing through DCP until rank 0
has checked the folder (`cadence.train._manifest.verify`): the manifest's signature
under this user's key (see [Note: the checkpoint key] there), then that the folder
holds exactly the files it lists, each of the listed size and sha256. Rank 0
broadcasts the verdict, and every rank refuses alike (`ResumeRefusedError`, naming
the file and the fix) or loads. A stripped signature is refused like a wrong one; a manifest without
hashes (an older cadence's, or a downgraded one) is refused unless
``--trust-checkpoint``, which also skips the signature (the user vouches for the
folder; the hashes, where there are any, are still checked).

What still unpickles, and only after that check: DCP's ``.metadata`` (its index of
the items, a pickle DCP reads on every rank). DCP's data files hold tensors, read by
torch's weights-only loader, and the optimizer's param groups, which DCP would read
with the full unpickler and `WeightsOnlyPlanner` reads with the weights-only one.
cadence's own data is not pickled at all: the RNG states are tensors and JSON, the
history is JSON, and nothing in this package calls ``pickle.loads`` on them. (Rank
0's verdict reaches the other ranks through ``broadcast_object_list``, a pickle
between the job's own processes of values rank 0 parsed from JSON.)

Time of check and time of use: each rank opens every file DCP reads through
`CheckedReader`, which hashes it on the open descriptor and then reads through that
same descriptor (`open_verified`), so a file replaced after rank 0's check (renamed
over, or a symlink planted) is refused, not read. What remains is a write into the
very file after it was hashed, which needs write permission on the file itself: the
run's own user, or root. Cost: rank 0 reads the whole checkpoint once to verify it,
and each rank reads each file it loads from twice (hash, then its slices; the second
read usually from the page cache). Saving hashes the files once DCP has written them,
in the commit step, which with ``--async-checkpoint`` runs on the save's thread.
Rank 0 hashes every rank's files, so verifying a very large checkpoint takes as long
as reading it: the other ranks wait in the broadcast, within --collective-timeout.

[Note: a run's lineage]
Each run has a lineage id: a fresh run draws one, ``--resume`` carries on the one in
the manifest it loads (`TrainState.lineage`), and every manifest records it. ``--keep``
prunes only checkpoints of this run's lineage, so a checkpoint of another run (copied
in, or written by a cadence without lineage ids, whose manifest has none) is never
deleted. Mixing runs in one folder is refused up front anyway (`check_run_dir`): a
fresh run into a ``--run-dir`` that holds checkpoints needs ``--resume`` (continue
them) or ``--overwrite`` (delete them first, `delete_checkpoints`).
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar, cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from cadence.errors import UntrustedPathError
from cadence.topology import subgroup_timeout
from cadence.train import lr_schedule
from cadence.train._dcp_read import CheckedReader, WeightsOnlyPlanner
from cadence.train._errors import CheckpointError, ResumeRefusedError, TrainConfigError
from cadence.train._manifest import (
    HISTORY,
    MANIFEST,
    entry_size,
    file_entries,
    run_key,
    sign,
    verify,
)
from cadence.train._rng import restore_rng, rng_placeholders, rng_state_dict
from cadence.train.build import TrainState
from cadence.train.config import TrainConfig
from cadence.train.history import RunHistory

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "ResumeRefusedError",
    "check_run_dir",
    "delete_checkpoints",
    "find_latest",
    "load_checkpoint",
]

# The name prefix of the pool thread torch's `dcp.async_save` runs a save on (2.13 to
# 2.15), and how long `wait` gives it to exit once its save has committed.
_SAVE_THREAD = "AsyncCheckpointExecutor"
_JOIN_S = 60.0
# Used with fullmatch only: ASCII digits, no leading zero, nothing after them.
_STEP = re.compile(r"step-([1-9][0-9]*)")
# The flags a checkpoint's numbers depend on: a resume under other values would
# silently continue another run, so it is refused (see `_check_compatible`).
_MUST_MATCH = (
    "batch_size",
    "lr",
    "seed",
    "fsdp",
    "mixed_precision",
    "pp",
    "model",
    "warmup_steps",
    "lr_schedule",
    "min_lr",
    "clip_grad_norm",
    "model_factory",
    "model_config",
    "data",
    "data_dtype",
    "tokenizer",
    "val_fraction",
)
# Keys a manifest written before ``--data`` (or ``--model``) lacks: it trained with
# their defaults.
_ADDED_LATER: dict[str, Any] = {
    "warmup_steps": 0,
    "lr_schedule": "constant",
    "min_lr": None,
    "clip_grad_norm": None,
    "model_factory": "",
    "model_config": {},
    "data": "",
    "data_dtype": "",
    "tokenizer": "",
    "val_fraction": None,
}

# Refusals rank 0 raises while choosing a checkpoint, raised alike on every rank.
_AGREED: dict[str, type[Exception]] = {
    c.__name__: c for c in (ResumeRefusedError, CheckpointError, UntrustedPathError)
}
_T = TypeVar("_T")


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


def _manifest(
    cfg: TrainConfig, state: TrainState, step: int, folder: Path, lineage: str
) -> dict[str, Any]:
    """The manifest of the checkpoint in ``folder``, unsigned; hashes every file."""
    layout = state.layout
    return {
        "step": step,
        "lineage": lineage,
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
        # A cosine schedule decays over --steps: see `_check_compatible`.
        "steps": cfg.steps,
        "files": file_entries(folder),
    }


def _why_incomplete(folder: Path) -> str | None:
    """None when ``folder`` is a complete checkpoint, else why it is not."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (its save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
        if not isinstance(files, dict):
            raise ValueError("its files are not a table")
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MANIFEST}: {exc}"
    if ".metadata" not in files:
        return "the manifest lists no DCP .metadata"
    for name, entry in files.items():
        path = folder / name
        size = entry_size(entry)
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
    return None


def _lineage(folder: Path) -> str | None:
    """The lineage id in ``folder``'s manifest; None when there is none (no manifest,
    an unreadable one, or one written before lineage ids). See [Note: a run's lineage]."""
    try:
        lineage = json.loads((folder / MANIFEST).read_text()).get("lineage")
    except (OSError, ValueError, AttributeError):
        return None
    return lineage if isinstance(lineage, str) and lineage else None


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """The ``step-<N>`` entries of ``root``, oldest first (see the module docstring on names)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.fullmatch(p.name))]
    return sorted(found)


def _misnamed(root: Path) -> list[Path]:
    """Entries named ``step-`` something that is not a step number: ignored."""
    if not root.is_dir():
        return []
    return sorted(
        p for p in root.iterdir() if p.name.startswith("step-") and not _STEP.fullmatch(p.name)
    )


def find_latest(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint in ``run_dir`` (or None), and a line per newer
    folder that was skipped, saying why (and one per ignored ``step-*`` name). See
    [Note: a checkpoint counts only once complete]."""
    root = checkpoint_dir(run_dir)
    skipped = [f"{p.name}: an unfinished save" for p in sorted(root.glob(".step-*.tmp"))]
    # repr: such a name may hold a newline or look like a number it is not.
    skipped += [
        f"{p.name!r}: not a checkpoint name (step-<N>, N in ASCII digits), ignored"
        for p in _misnamed(root)
    ]
    for _, folder in reversed(_step_folders(root)):
        why = _why_incomplete(folder)
        if why is None:
            return folder, skipped
        skipped.append(f"{folder.name}: {why}")
    return None, skipped


def _check_steps(cfg: TrainConfig, step: int, folder: str | Path) -> None:
    """Refuse a resume with nothing to train below the checkpoint: ``--steps`` is the
    run's total, so a smaller one would load and stop at once, with no step timed."""
    if cfg.steps < step:
        raise ResumeRefusedError(
            f"--resume continues {folder} (step {step}), but --steps is {cfg.steps}: "
            f"--steps counts the whole run, so pass --steps above {step} to train on"
        )


def check_run_dir(cfg: TrainConfig) -> None:
    """Refuse, before any rank starts, a run that the checkpoints already in
    ``cfg.run_dir`` make wrong. Reads the folder only.

    Raises:
        TrainConfigError: a fresh run (neither ``--resume`` nor ``--overwrite``) into a
            folder that holds ``step-<N>`` checkpoints: its ``--keep`` would prune
            among the other run's checkpoints and its saves would replace theirs.
        ResumeRefusedError: ``--resume`` with ``--steps`` below the newest complete
            checkpoint's step.
    """
    root = checkpoint_dir(cfg.run_dir)
    if cfg.resume:
        folder, _ = find_latest(cfg.run_dir)
        if folder is not None:
            _check_steps(cfg, json.loads((folder / MANIFEST).read_text())["step"], folder)
        return
    found = _step_folders(root)
    if found and not cfg.overwrite:
        raise TrainConfigError(
            f"--run-dir {cfg.run_dir} already holds checkpoints of an earlier run (newest: "
            f"step-{found[-1][0]} in {root}): add --resume to continue that run, or "
            "--overwrite to delete its checkpoints and start over"
        )


def delete_checkpoints(run_dir: str | Path) -> list[str]:
    """``--overwrite``: delete every ``step-<N>`` checkpoint and unfinished save in
    ``run_dir`` (whatever its lineage), before any rank starts. Returns the deleted
    checkpoints' names, oldest first. Other entries (misnamed folders, other files)
    are left alone: they are not checkpoints this run could mix with."""
    root = checkpoint_dir(run_dir)
    deleted = []
    for _, folder in _step_folders(root):
        if folder.is_dir():
            shutil.rmtree(folder)
        else:
            folder.unlink()
        deleted.append(folder.name)
    for stale in root.glob(".step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    return deleted


def _check_compatible(cfg: TrainConfig, state: TrainState, manifest: dict[str, Any]) -> None:
    """Refuse, on every rank alike, a checkpoint this run cannot continue exactly."""
    saved = manifest["config"]
    now = {k: v for k, v in asdict(cfg).items() if k in _MUST_MATCH}
    differ = [k for k in _MUST_MATCH if saved.get(k, _ADDED_LATER.get(k)) != now[k]]
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
    problem = lr_schedule.other_steps_problem(cfg, manifest.get("steps", cfg.steps))
    if problem:
        raise ResumeRefusedError(problem)
    old = manifest["world_size"]
    if old != layout.world and layout.wrapper != "fully_shard":
        raise ResumeRefusedError(
            f"the checkpoint was saved by {old} ranks and this run has {layout.world}: only "
            f"--fsdp checkpoints are resharded on load, and this run wraps with "
            f"{layout.wrapper}. Resume on {old} ranks (pipeline stages and replicated "
            "states are saved per rank layout)"
        )


def _rank0_decides(decide: Callable[[], _T]) -> _T:
    """``decide()`` on rank 0, and its result or its refusal on every rank: a refusal
    raised on rank 0 alone would leave the others waiting in their next collective."""
    box: list[Any] = [None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box = [(True, decide())]
        except Exception as exc:  # raised again below, on rank 0 as itself
            error = exc
            box = [(False, (type(exc).__name__, str(exc)))]
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if ok:
        return cast(_T, value)  # rank 0's decide() result, carried by the broadcast
    if error is not None:
        raise error
    name, message = value
    if name in _AGREED:
        raise _AGREED[name](message)
    raise CheckpointError(f"rank 0 failed with {name}: {message}")


def _choose(cfg: TrainConfig) -> tuple[str | None, Any, list[str], str | None, str]:
    """Rank 0: the newest complete checkpoint, verified (see [Note: a checkpoint is
    verified before anything in it is unpickled]): its folder, manifest, the skipped
    folders, its history text (None before content hashes) and what went unchecked."""
    folder, skipped = find_latest(cfg.run_dir)
    if folder is None:
        return None, None, skipped, None, ""
    found = verify(folder, trust=cfg.trust_checkpoint)
    return str(folder), found.manifest, skipped, found.history, found.note


def load_checkpoint(cfg: TrainConfig, state: TrainState) -> tuple[RunHistory, str]:
    """Load the newest complete checkpoint of ``cfg.run_dir`` into ``state``.

    Collective: rank 0 picks the folder and verifies it, and every rank loads that one.
    Returns the restored history (empty when there is no checkpoint: a fresh start) and
    a line saying what was loaded and what was skipped. Raises `ResumeRefusedError` on
    every rank alike when the checkpoint fails verification (see [Note: a checkpoint
    is verified before anything in it is unpickled]), belongs to another kind of run,
    or when ``--steps`` is below its step. Sets ``state.step`` and ``state.lineage``
    (the checkpoint's: see [Note: a run's lineage]).
    """
    folder_s, manifest, skipped, history_text, unchecked = _rank0_decides(lambda: _choose(cfg))
    notes = [f"skipped {line}" for line in skipped]
    if folder_s is None:
        return RunHistory(), "; ".join(
            [f"no complete checkpoint in {cfg.run_dir}: fresh start", *notes]
        )
    _check_compatible(cfg, state, manifest)
    _check_steps(cfg, manifest["step"], folder_s)
    root = _stateful_root(state)
    model_sd, optim_sd = get_state_dict(root, state.optimizer)
    rank = dist.get_rank()
    okey = _optim_key(state)
    sd: dict[str, Any] = {"model": model_sd, okey: optim_sd}
    hashed = history_text is not None
    reader = CheckedReader(folder_s, manifest["files"] if hashed else None)
    # Ranks that did not exist when it was saved keep their fresh RNG streams. An
    # older checkpoint's RNG states were pickled: never loaded, and its history is a
    # DCP item (a string, which the weights-only loader reads).
    restore = hashed and rank < manifest["world_size"]
    if restore:
        sd.update(rng_placeholders(reader.read_metadata(), rank))
    if not hashed:
        sd["history"] = ""
    skey = f"lr_schedule/{okey}"  # beside the optimizer it schedules
    if state.scheduler is not None:
        sd.update(
            lr_schedule.scheduler_placeholders(
                reader.read_metadata(), skey, len(state.optimizer.param_groups)
            )
        )
    dcp.load(sd, storage_reader=reader, planner=WeightsOnlyPlanner())
    set_state_dict(root, state.optimizer, model_state_dict=sd["model"], optim_state_dict=sd[okey])
    if restore:
        restore_rng(sd, rank)
    history = RunHistory.from_json(history_text if history_text is not None else sd["history"])
    step = manifest["step"]
    if history.step != step:
        raise CheckpointError(
            f"{folder_s}: its history has {history.step} steps, its manifest {step}"
        )
    if state.scheduler is not None:
        lr_schedule.restore_scheduler(state.scheduler, state.optimizer, sd, skey, step)
    state.step = step
    # None (a checkpoint written before lineage ids): the Checkpointer draws a new one.
    state.lineage = manifest.get("lineage")
    history.resumes.append(step)
    loaded = f"resumed from {Path(folder_s).name} (step {step})"
    return history, "; ".join([loaded, *([unchecked] if unchecked else []), *notes])


def _prune(root: Path, keep: int, lineage: str) -> None:
    """``--keep``: delete ``lineage``'s checkpoints older than its newest ``keep``
    complete ones. Other lineages' folders, and folders with no readable lineage, are
    never touched (see [Note: a run's lineage])."""
    ours = [(s, p) for s, p in _step_folders(root) if _lineage(p) == lineage]
    complete = [s for s, p in ours if _why_incomplete(p) is None]
    if len(complete) > keep:
        oldest_kept = complete[-keep]
        for s, p in ours:
            if s < oldest_kept:
                shutil.rmtree(p, ignore_errors=True)


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
        self._pending: Future[None] | None = None
        self._workers: list[threading.Thread] = []
        self._committed = threading.Event()
        self._failed: BaseException | None = None
        # Every rank is a member (ranks=None), so new_group returns a ProcessGroup.
        self._group = (
            cast(dist.ProcessGroup, dist.new_group(backend="gloo", timeout=subgroup_timeout()))
            if cfg.async_checkpoint
            else None
        )
        # Only rank 0 writes manifests, so only its id is ever recorded.
        if state.lineage is None:
            state.lineage = uuid.uuid4().hex
        self.lineage: str = state.lineage
        # Read (or made) before the first step: a key others could change stops the
        # run here, on every rank, rather than at its first save. Only rank 0 holds
        # the key; the others learn only whether it could be read.
        key: list[bytes] = []
        _rank0_decides(lambda: key.append(run_key(self.lineage)))
        self._key = key[0] if key else None
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
            **rng_state_dict(self.rank),
        }
        if self.state.scheduler is not None:
            skey = f"lr_schedule/{_optim_key(self.state)}"
            sd.update(lr_schedule.scheduler_state(self.state.scheduler, skey))
        # The text now: the history grows while a background save runs.
        text = history.to_json()
        tmp = self.root / f".step-{step}.tmp"
        if self._group is None:
            dcp.save(sd, checkpoint_id=tmp)
            self._commit(tmp, step, text)
            return
        before = set(threading.enumerate())
        fut = dcp.async_save(sd, checkpoint_id=tmp, process_group=self._group)
        assert isinstance(fut, Future)
        # torch starts one pool thread per save and only asks it to stop (no join), so
        # it can outlive the future by a moment; `wait` joins it, so no thread of a
        # save outlives the saver.
        self._workers = [
            t for t in set(threading.enumerate()) - before if t.name.startswith(_SAVE_THREAD)
        ]
        self._committed.clear()
        fut.add_done_callback(lambda f: self._on_done(f, tmp, step, text))
        self._pending = fut

    def _on_done(self, fut: Future[None], tmp: Path, step: int, history: str) -> None:
        # On the save's thread: filesystem work only (hashing included), no collectives.
        try:
            fut.result()
            self._commit(tmp, step, history)
        except BaseException as exc:  # raised again by `wait` on the main thread
            self._failed = exc
        finally:
            self._committed.set()

    def _commit(self, tmp: Path, step: int, history: str) -> None:
        """Rank 0: the history, the signed manifest (hashing every file), then the
        atomic rename, then prune to ``--keep``."""
        if self.rank != 0:
            return
        assert self._key is not None
        (tmp / HISTORY).write_text(history)
        manifest = sign(_manifest(self.cfg, self.state, step, tmp, self.lineage), self._key)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        final = self.root / f"step-{step}"
        if final.exists():
            other = _lineage(final)
            # Only reachable past `check_run_dir` (run_rank called directly): another
            # run's complete checkpoint is never replaced. See [Note: a run's lineage].
            if _why_incomplete(final) is None and other != self.lineage:
                raise CheckpointError(
                    f"{final} is a complete checkpoint of another run (lineage {other}); "
                    "this run will not replace it: resume that run (--resume), or start "
                    "over with --overwrite"
                )
            shutil.rmtree(final)  # an older, incomplete save of the same step
        tmp.rename(final)
        if self.cfg.keep:
            _prune(self.root, self.cfg.keep, self.lineage)

    def wait(self) -> None:
        """Block until the background save (if any) is written and committed."""
        if self._pending is not None:
            # Not fut.result(): the callback (the commit) may still run after it returns.
            self._committed.wait()
            self._pending = None
            for worker in self._workers:
                worker.join(timeout=_JOIN_S)
            self._workers = []
        if self._failed is not None:
            exc, self._failed = self._failed, None
            raise CheckpointError(f"the background checkpoint save failed: {exc}") from exc

    def close(self) -> None:
        """Wait for a background save, then free its group: on every exit path.

        After an error in a step too: a save in flight is waited (so it commits whole,
        or fails and leaves only its temporary folder, which the next run removes) before
        the caller destroys the default group its collectives ran beside.
        """
        try:
            self.wait()
        finally:
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None
