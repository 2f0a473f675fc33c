"""A checkpoint is verified before anything in it is unpickled.

Specification (see [Note: a checkpoint is verified before anything in it is unpickled]
in ``cadence/train/checkpoint.py``):
- the manifest (``cadence.json``) lists every file of the checkpoint with its size and
  sha256, and is signed: HMAC-SHA256 of its canonical JSON under a per-run key,
  HMAC-SHA256(the user's key, the lineage id); the user's key is the file named by
  ``CADENCE_CHECKPOINT_KEY_FILE``, else ``~/.config/cadence/checkpoint.key``, created
  private on first use;
- cadence stores nothing of its own as a pickle: the RNG states are uint8 tensors
  and JSON, the history is ``history.json``;
- ``--resume`` refuses, on every rank, naming the file and the fix, a checkpoint
  whose data file has a flipped byte (same size), or that holds a file its manifest
  does not list;
- a ``.metadata`` replaced by a malicious pickle, with its manifest entry rewritten
  to match, is refused whether the signature is stripped or left stale, and the
  pickle never runs;
- a pickle planted in place of the RNG state never runs: refused for its signature,
  and refused as "not tensors" even under ``--trust-checkpoint``;
- DCP's non-tensor items (the optimizer's param groups) are read with torch's
  weights-only loader: a pickle planted there never runs, even under
  ``--trust-checkpoint``;
- every rank opens each file DCP reads through a descriptor whose bytes it hashed:
  a file swapped after rank 0's check is refused, not read;
- a checkpoint signed with another key (another user or machine) is refused, naming
  ``--trust-checkpoint``; with it the run resumes with the same loss curve, and the
  content hashes are still checked;
- a checkpoint written before content hashes (no hashes, no signature: also what a
  downgraded manifest looks like) is refused naming ``--trust-checkpoint``; with it
  the run resumes its history, and the RNG states (pickled then) are not loaded;
- a key file others may read stops a checkpointing run before it trains;
- ``--trust-checkpoint`` is a ``cadence train`` flag, refused without ``--resume``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import shutil
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from cadence.cli import build_parser
from cadence.launch import LaunchError
from cadence.testing import run_distributed
from cadence.train._errors import TrainConfigError
from cadence.train.config import TrainConfig
from tests.train.bodies_checkpoint import body_train
from tests.train.conftest import KEY_ENV

RUN = {"steps": 6, "checkpoint_every": 2}
RESUME = {**RUN, "resume": True}
TRUST = {**RESUME, "trust_checkpoint": True}


class _Planted:
    """Unpickling this creates the file ``path``: it stands for any code a pickle runs."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """A 6-step run on 2 ranks with checkpoints step-2, step-4, step-6, and its curve."""
    run = tmp_path_factory.mktemp("saved") / "run"
    out = run_distributed(body_train, RUN, str(run), world_size=2, timeout=150)
    return run, out[0]["losses"]


def _copy(saved: tuple[Path, list[float]], tmp_path: Path, newest: int = 6) -> Path:
    """A copy of the saved run whose newest checkpoint is step-``newest``."""
    run = tmp_path / "run"
    shutil.copytree(saved[0], run)
    for step in (4, 6):
        if step > newest:
            shutil.rmtree(run / "checkpoints" / f"step-{step}")
    return run


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step}"


def _resume(run: Path, **flags: object) -> list[dict]:
    return run_distributed(body_train, {**RESUME, **flags}, str(run), world_size=2, timeout=150)


def _refused(run: Path, **flags: object) -> str:
    """The error of a resume that must be refused, on every rank alike (no rank hangs)."""
    with pytest.raises(LaunchError) as info:
        _resume(run, **flags)
    message = str(info.value)
    assert "ResumeRefusedError" in message, message
    assert "did not finish within the timeout" not in message
    return message


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _forge(folder: Path, *, keep_signature: bool = False) -> None:
    """What someone without the key can do: rewrite ``cadence.json`` so that every
    entry matches the files now in ``folder`` (in the manifest's own format)."""
    path = folder / "cadence.json"
    manifest = json.loads(path.read_text())
    hashed = any(isinstance(v, dict) for v in manifest["files"].values())
    manifest["files"] = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} if hashed else p.stat().st_size
        for p in sorted(folder.iterdir())
        if p.name != "cadence.json"
    }
    if not keep_signature:
        manifest.pop("hmac", None)
    path.write_text(json.dumps(manifest))


def _resave(folder: Path, tmp_path: Path, edit) -> None:
    """Rewrite the DCP part of ``folder`` with ``edit`` applied to its state dict (in
    this process, without a process group; a payload ``edit`` adds is pickled, not run)."""
    pt = tmp_path / "resave.pt"
    dcp_to_torch_save(folder, pt)
    sd = edit(torch.load(pt, weights_only=False))
    for p in folder.iterdir():
        if p.name == ".metadata" or p.suffix == ".distcp":
            p.unlink()
    dcp.save(sd, checkpoint_id=folder, no_dist=True)


def _data_file(folder: Path) -> Path:
    return max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _private_key_file(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    return folder / "checkpoint.key"


def test_the_manifest_hashes_every_file_and_is_signed(saved, checkpoint_key_file: Path) -> None:
    folder = _step(saved[0], 6)
    manifest = json.loads((folder / "cadence.json").read_text())
    on_disk = {p.name for p in folder.iterdir()} - {"cadence.json"}
    assert set(manifest["files"]) == on_disk and ".metadata" in on_disk
    for name, entry in manifest["files"].items():
        assert entry == {"size": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
    run_key = hmac.new(
        checkpoint_key_file.read_bytes(), manifest["lineage"].encode(), hashlib.sha256
    ).digest()
    body = {k: v for k, v in manifest.items() if k != "hmac"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert manifest["hmac"] == hmac.new(run_key, canonical, hashlib.sha256).hexdigest()
    assert stat.S_IMODE(checkpoint_key_file.stat().st_mode) == 0o600


def test_cadence_stores_nothing_of_its_own_as_a_pickle(saved) -> None:
    folder = _step(saved[0], 6)
    items = FileSystemReader(folder).read_metadata().state_dict_metadata
    rng = {k: v for k, v in items.items() if k.startswith("rng/")}
    assert {"rng/rank0/torch", "rng/rank0/json", "rng/rank1/torch", "rng/rank1/json"} <= set(rng)
    for value in rng.values():
        assert isinstance(value, TensorStorageMetadata) and value.properties.dtype == torch.uint8
    assert "history" not in items
    history = json.loads((folder / "history.json").read_text())
    assert history["losses"] == saved[1] and history["checkpoints"] == [2, 4, 6]


@pytest.mark.parametrize("trust", [False, True], ids=["signed", "trusted"])
def test_a_flipped_byte_in_a_data_file_is_refused_naming_it(saved, tmp_path, trust) -> None:
    run = _copy(saved, tmp_path)
    data = _data_file(_step(run, 6))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: the size check alone misses it
    data.write_bytes(bytes(raw))
    message = _refused(run, trust_checkpoint=trust)
    assert f"step-6/{data.name} does not match its sha256" in message
    assert "--overwrite" in message


def test_a_file_the_manifest_does_not_list_is_refused(saved, tmp_path) -> None:
    run = _copy(saved, tmp_path)
    (_step(run, 6) / "extra.distcp").write_bytes(b"\0" * 16)
    message = _refused(run)
    assert "'extra.distcp'" in message and "does not list" in message


@pytest.mark.parametrize("signature", ["stripped", "stale"])
def test_a_malicious_metadata_pickle_is_refused_and_never_runs(saved, tmp_path, signature) -> None:
    run = _copy(saved, tmp_path)
    folder = _step(run, 6)
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    _forge(folder, keep_signature=signature == "stale")
    message = _refused(run)
    assert "signature" in message and "--trust-checkpoint" in message
    assert not marker.exists()


def test_a_pickle_in_place_of_the_rng_state_never_runs(saved, tmp_path) -> None:
    run = _copy(saved, tmp_path)
    folder = _step(run, 6)
    marker = tmp_path / "ran"

    def plant(sd: dict) -> dict:
        sd = {k: v for k, v in sd.items() if not k.startswith("rng/rank0")}
        sd["rng/rank0"] = pickle.dumps(_Planted(marker))
        return sd

    _resave(folder, tmp_path, plant)
    _forge(folder)
    assert "signature" in _refused(run)
    assert not marker.exists()
    message = _refused(run, trust_checkpoint=True)
    assert "rng/rank0" in message and "uint8 tensors" in message
    assert not marker.exists()


def test_a_pickle_in_the_optimizer_state_never_runs(saved, tmp_path) -> None:
    run = _copy(saved, tmp_path)
    folder = _step(run, 6)
    marker = tmp_path / "ran"

    def plant(sd: dict) -> dict:
        # Each param group value is a non-tensor item, which DCP itself fully unpickles.
        sd["optim"]["param_groups"][0]["lr"] = _Planted(marker)
        return sd

    _resave(folder, tmp_path, plant)
    _forge(folder)
    with pytest.raises(LaunchError, match="Weights only load failed"):
        _resume(run, trust_checkpoint=True)  # vouched for: the hashes match, no signature
    assert not marker.exists()


def test_a_file_swapped_after_the_check_is_refused_as_dcp_opens_it(saved, tmp_path) -> None:
    from cadence.train._dcp_read import CheckedReader
    from cadence.train._errors import ResumeRefusedError

    run = _copy(saved, tmp_path)
    folder = _step(run, 6)
    files = json.loads((folder / "cadence.json").read_text())["files"]  # as verified
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(ResumeRefusedError, match=r"step-6/\.metadata does not match its sha256"):
        CheckedReader(folder, files).read_metadata()
    assert not marker.exists()


def test_another_key_is_refused_unless_trusted(saved, tmp_path, monkeypatch) -> None:
    run = _copy(saved, tmp_path, newest=4)
    monkeypatch.setenv(KEY_ENV, str(_private_key_file(tmp_path, "other-user")))
    message = _refused(run)
    assert "step-4/cadence.json" in message and "another key" in message
    assert "--trust-checkpoint" in message
    out = _resume(run, trust_checkpoint=True)
    for r in out:
        assert r["history"].resumes == [4]
        assert r["losses"] == saved[1]  # bit-identical: weights, moments, RNG, data position


def test_a_checkpoint_without_hashes_is_refused_naming_the_opt_out(saved, tmp_path) -> None:
    run = _copy(saved, tmp_path, newest=4)
    folder = _step(run, 4)
    marker = tmp_path / "ran"
    history = (folder / "history.json").read_text()

    def older_cadence(sd: dict) -> dict:
        # The layout before content hashes: history and RNG states as DCP objects, the
        # RNG pickled (here a payload, to show it is never unpickled).
        sd = {k: v for k, v in sd.items() if not k.startswith("rng/")}
        sd["history"] = history
        for rank in (0, 1):
            sd[f"rng/rank{rank}"] = pickle.dumps(_Planted(marker))
        return sd

    _resave(folder, tmp_path, older_cadence)
    (folder / "history.json").unlink()
    manifest = json.loads((folder / "cadence.json").read_text())
    manifest = {k: v for k, v in manifest.items() if k not in ("hmac", "format")}
    manifest["files"] = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    manifest["files"].pop("cadence.json", None)
    (folder / "cadence.json").write_text(json.dumps(manifest))
    message = _refused(run)
    assert "no content hashes" in message and "--trust-checkpoint" in message
    out = _resume(run, trust_checkpoint=True)
    for r in out:
        assert r["history"].resumes == [4] and r["losses"][:4] == saved[1][:4]
        assert len(r["losses"]) == 6
    assert not marker.exists()


def test_a_key_others_may_read_stops_a_run_before_it_trains(tmp_path, monkeypatch) -> None:
    key = _private_key_file(tmp_path, "keys")
    key.write_bytes(os.urandom(32))
    os.chmod(key, 0o644)
    monkeypatch.setenv(KEY_ENV, str(key))
    with pytest.raises(LaunchError, match=r"UntrustedPathError: .*mode 644"):
        run_distributed(body_train, RUN, str(tmp_path / "run"), world_size=2, timeout=150)
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").glob("step-*")
    )


def test_trust_checkpoint_is_a_train_flag() -> None:
    args = build_parser().parse_args(["train", "--resume", "--trust-checkpoint"])
    assert args.trust_checkpoint is True
    assert build_parser().parse_args(["train"]).trust_checkpoint is False
    with pytest.raises(TrainConfigError, match=r"--trust-checkpoint .*: add --resume"):
        TrainConfig(trust_checkpoint=True, run_dir="runs/a")


def test_the_user_key_defaults_to_the_config_folder(tmp_path, monkeypatch) -> None:
    from cadence.train._manifest import key_path, run_key

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.setenv("HOME", str(home))
    assert key_path() == home / ".config" / "cadence" / "checkpoint.key"
    first, second = run_key("lineage-a"), run_key("lineage-b")
    assert len(first) == 32 and first != second and run_key("lineage-a") == first
    assert stat.S_IMODE(key_path().stat().st_mode) == 0o600
    assert stat.S_IMODE(key_path().parent.stat().st_mode) == 0o700
