"""A checkpoint's manifest (``cadence.json``): each file's size and sha256, signed.

Torch-free. The manifest of ``step-<N>/`` records the run (step, lineage, layout, the
settings a resume must match), every other file of the folder with its size and
sha256, and ``hmac``: HMAC-SHA256 of the manifest's canonical JSON (sorted keys, no
spaces, without ``hmac`` itself) under the run's key. `verify` checks all of it on
resume, before anything in the folder is deserialized; `open_verified` checks a file
again on the descriptor it is then read through.

[Note: the checkpoint key]
The run's key is HMAC-SHA256(user key, lineage id): the user key is 32 random bytes
in the file ``$CADENCE_CHECKPOINT_KEY_FILE``, else ``~/.config/cadence/checkpoint.key``,
created on first use and trusted only when this user alone controls it
(`cadence._util.owned.read_or_create_key`). Deriving one key per lineage keeps a
signature from being carried from one run's manifest to another's. Only rank 0
reads the key: it writes every manifest and checks the one it resumes from. A
checkpoint written by another user, or copied from another machine, was signed with
another key; its owner's key file (copied over, private) or ``--trust-checkpoint``
(the user vouches for the folder: the signature is skipped, the content hashes are
still checked) resumes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cadence._util.owned import make_private_dir, read_or_create_key
from cadence.train._errors import CheckpointError, ResumeRefusedError

__all__ = [
    "HISTORY",
    "KEY_ENV",
    "MANIFEST",
    "CheckpointError",
    "ResumeRefusedError",
    "Verified",
    "entry_size",
    "file_entries",
    "key_path",
    "open_verified",
    "run_key",
    "sign",
    "verify",
]

MANIFEST = "cadence.json"
HISTORY = "history.json"
# 2: content hashes and a signature. Manifests without "format" came before them.
FORMAT = 2
KEY_ENV = "CADENCE_CHECKPOINT_KEY_FILE"
_DEFAULT_KEY = Path("~/.config/cadence/checkpoint.key")
_CHUNK = 1 << 20
_OPT_OUT = (
    "if you vouch for this run directory, resume with --trust-checkpoint (the content "
    "hashes are still checked); else start over with --overwrite"
)


def key_path() -> Path:
    """The user key's file: ``$CADENCE_CHECKPOINT_KEY_FILE``, else the config folder's."""
    return Path(os.environ.get(KEY_ENV) or _DEFAULT_KEY).expanduser()


def run_key(lineage: str) -> bytes:
    """The key that signs ``lineage``'s manifests (see [Note: the checkpoint key]).
    Raises `cadence._util.owned.UntrustedPathError` for a key file others could change."""
    path = key_path()
    make_private_dir(path.parent, "the folder of the checkpoint key")
    user_key = read_or_create_key(path, "the checkpoint key")
    return hmac.new(user_key, lineage.encode(), hashlib.sha256).digest()


def _canonical(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "hmac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(manifest: dict[str, Any], key: bytes) -> dict[str, Any]:
    """``manifest`` with its format and its ``hmac`` under ``key``."""
    body = {**manifest, "format": FORMAT}
    return {**body, "hmac": hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()}


def _digest(stream: IO[bytes]) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    while chunk := stream.read(_CHUNK):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def file_entries(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file of ``folder`` but the manifest: ``{name: {"size", "sha256"}}``."""
    entries = {}
    for path in sorted(folder.iterdir()):
        if path.name != MANIFEST:
            with path.open("rb") as stream:
                size, sha = _digest(stream)
            entries[path.name] = {"size": size, "sha256": sha}
    return entries


def entry_size(entry: object) -> int | None:
    """A file's size in a manifest (an int before content hashes), or None if malformed."""
    if isinstance(entry, dict):
        entry = entry.get("size")
    return entry if isinstance(entry, int) and not isinstance(entry, bool) else None


def _hashed(manifest: dict[str, Any], where: Path) -> bool:
    """True for a manifest with content hashes, False for one written before them."""
    fmt = manifest.get("format")
    if fmt is None:
        return False
    files = manifest.get("files")
    ok = isinstance(files, dict) and all(
        isinstance(e, dict) and entry_size(e) is not None and isinstance(e.get("sha256"), str)
        for e in files.values()
    )
    if fmt != FORMAT or not ok:
        raise ResumeRefusedError(
            f"{where} is not a manifest this cadence reads (format {fmt!r}, or malformed "
            f"file entries): move {where.parent} out of {where.parent.parent} to resume "
            "from the checkpoint before it, or start over with --overwrite"
        )
    return True


@contextlib.contextmanager
def open_verified(path: Path, entry: dict[str, Any], when: str = "") -> Iterator[IO[bytes]]:
    """``path`` open for reading, once its bytes match ``entry`` (size and sha256).

    The check and the read go through one descriptor, opened without following a
    symlink: a file swapped in after the check is not the one read. Raises
    `ResumeRefusedError` naming the file and the fix.
    """
    where = f"{path.parent.name}/{path.name}"
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ResumeRefusedError(
            f"{where} cannot be opened ({exc.strerror}; a checkpoint holds regular files "
            f"only): move {path.parent} out of {path.parent.parent} to resume from the "
            "checkpoint before it, or start over with --overwrite"
        ) from None
    with os.fdopen(fd, "rb") as stream:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ResumeRefusedError(
                f"{where} is not a regular file: move {path.parent} out of "
                f"{path.parent.parent} to resume from the checkpoint before it, or start "
                "over with --overwrite"
            )
        size, sha = _digest(stream)
        if size != entry["size"] or not hmac.compare_digest(sha, entry["sha256"]):
            raise ResumeRefusedError(
                f"{where} does not match its sha256 in {MANIFEST}{when} (altered or "
                f"corrupted since it was written): move {path.parent} out of "
                f"{path.parent.parent} to resume from the checkpoint before it, or start "
                "over with --overwrite"
            )
        stream.seek(0)
        yield stream


@dataclass(frozen=True)
class Verified:
    """A checkpoint `verify` accepted.

    Attributes:
        manifest: its manifest, as read once and checked.
        history: ``history.json``'s text, from the bytes whose hash was checked; None
            for a checkpoint written before content hashes (its history is a DCP item).
        note: what was not checked, for the resume line ("" when everything was).
    """

    manifest: dict[str, Any]
    history: str | None
    note: str


def _check_signature(folder: Path, manifest: dict[str, Any]) -> None:
    where = folder / MANIFEST
    signature, lineage = manifest.get("hmac"), manifest.get("lineage")
    if not isinstance(signature, str) or not isinstance(lineage, str) or not lineage:
        raise ResumeRefusedError(
            f"{where} lists content hashes but carries no signature: cadence signs every "
            f"manifest it writes, so this one was rewritten without the key; {_OPT_OUT}"
        )
    expected = hmac.new(run_key(lineage), _canonical(manifest), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(signature, expected):
        raise ResumeRefusedError(
            f"the signature of {where} does not match your checkpoint key ({key_path()}): "
            f"it was written with another key (another user, or another machine) or "
            f"altered since; {_OPT_OUT}"
        )


def _check_contents(folder: Path, files: dict[str, dict[str, Any]]) -> str:
    """Refuse unless ``folder`` holds exactly ``files``, byte for byte; the history text."""
    present = {p.name for p in folder.iterdir()} - {MANIFEST}
    extra = sorted(present - set(files))
    if extra:
        raise ResumeRefusedError(
            f"{folder} holds {', '.join(map(repr, extra))}, which its {MANIFEST} does not "
            "list: cadence writes nothing else into a checkpoint, so the folder was "
            "altered; delete it if you put it there, else move the folder out of "
            f"{folder.parent} to resume from the checkpoint before it"
        )
    missing = sorted(set(files) - present)
    if missing or ".metadata" not in files or HISTORY not in files:
        gone = ", ".join(map(repr, missing)) or f"'.metadata' or {HISTORY!r}"
        raise ResumeRefusedError(
            f"{folder} lacks {gone}: move the folder out of {folder.parent} to resume "
            "from the checkpoint before it, or start over with --overwrite"
        )
    history = ""
    for name in sorted(files):
        with open_verified(folder / name, files[name]) as stream:
            if name == HISTORY:
                history = stream.read().decode("utf-8")
    return history


def verify(folder: Path, *, trust: bool) -> Verified:
    """Check the checkpoint ``folder`` before anything in it is deserialized.

    In order: its manifest parses as JSON; it has content hashes (else it is refused
    unless ``trust``: a checkpoint written before them, or a downgraded manifest); its
    signature (skipped with ``trust``); the folder holds exactly the listed files, each
    of its size and sha256. Rank 0 only (it holds the key). Raises
    `ResumeRefusedError` naming the file and the fix.
    """
    where = folder / MANIFEST
    try:
        manifest = json.loads(where.read_bytes())
    except (OSError, ValueError) as exc:
        raise ResumeRefusedError(
            f"{where} cannot be read ({exc}): move {folder} out of {folder.parent} to "
            "resume from the checkpoint before it, or start over with --overwrite"
        ) from None
    if not isinstance(manifest, dict):
        raise ResumeRefusedError(
            f"{where} is not a JSON object: move {folder} out of {folder.parent} to resume "
            "from the checkpoint before it, or start over with --overwrite"
        )
    if not _hashed(manifest, where):
        if not trust:
            raise ResumeRefusedError(
                f"{where} has no content hashes and no signature (written by a cadence "
                "from before them, or stripped of them), so nothing shows the checkpoint "
                "is the one that was saved: if you vouch for this run directory, resume "
                "with --trust-checkpoint (it loads unchecked, and its RNG states, pickled "
                "by that cadence, are not restored); else start over with --overwrite"
            )
        return Verified(
            manifest,
            None,
            "trusted (--trust-checkpoint) with no content hashes to check; its RNG states "
            "were not restored (an older cadence pickled them)",
        )
    if not trust:
        _check_signature(folder, manifest)
    history = _check_contents(folder, manifest["files"])
    note = "" if not trust else "content hashes checked, signature not (--trust-checkpoint)"
    return Verified(manifest, history, note)
