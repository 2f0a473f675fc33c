"""Files and folders cadence trusts only when the current user alone controls them.

[Note: trusting a key on disk]
A key on disk is only a secret if nobody else can read it, and only *this user's*
secret if nobody else can replace it. Replacing works without reading: another local
user who can write the folder (or any folder above it without the sticky bit) can
rename the key away and put their own in its place, or a symlink to a file they own,
and then sign whatever they like. So before a key is used:

* the key is opened with ``O_NOFOLLOW`` and checked on the open descriptor (`fstat`,
  not a path that can change between the check and the read): a regular file, owned
  by this user, readable and writable by nobody else (no group or other bits);
* its folder is owned by this user and writable by nobody else;
* every folder above it is owned by this user or root, and one that others may write
  has the sticky bit (``/tmp``), so entries in it can only be renamed by their owner.

Anything else is refused with `UntrustedPathError`, which names the path, what is wrong
and the command that fixes it; nothing is read from the folder. On a platform without
POSIX ownership (no ``os.getuid``) the checks are skipped: there is no owner to compare.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from pathlib import Path

from cadence.errors import UntrustedPathError

__all__ = ["UntrustedPathError", "check_private_dir", "make_private_dir", "read_or_create_key"]

KEY_BYTES = 32


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def _owner_ok(st: os.stat_result, uid: int, *, root_ok: bool) -> bool:
    return st.st_uid == uid or (root_ok and st.st_uid == 0)


def check_private_dir(path: Path, what: str) -> None:
    """Refuse ``path`` unless only the current user (and root, above it) can change it."""
    uid = _uid()
    if uid is None:
        return
    path = Path(os.path.abspath(path))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UntrustedPathError(f"{what} {path} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedPathError(
            f"{what} {path} is a symlink; pass the real folder ({os.path.realpath(path)}) "
            "after checking who owns it"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedPathError(f"{what} {path} is not a folder")
    if st.st_uid != uid:
        raise UntrustedPathError(
            f"{what} {path} is owned by uid {st.st_uid}, not by you (uid {uid}): someone "
            "else controls what is in it; use a folder you own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedPathError(
            f"{what} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run `chmod go-w {path}` (or 700) if you trust what is in it, or use a new folder"
        )
    for parent in path.parents:
        pst = os.stat(parent)
        if not _owner_ok(pst, uid, root_ok=True):
            raise UntrustedPathError(
                f"{what} {path} lies under {parent}, owned by uid {pst.st_uid}: that user "
                "can replace the folder; use a folder under your home or a private path"
            )
        shared = pst.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if shared and not pst.st_mode & stat.S_ISVTX:
            raise UntrustedPathError(
                f"{what} {path} lies under {parent}, which others may write without the "
                f"sticky bit (mode {stat.S_IMODE(pst.st_mode):o}): they can rename {path} "
                "away and put their own in its place; use a folder under your home"
            )


def make_private_dir(path: Path, what: str) -> Path:
    """Create ``path`` (mode 0700) if missing, then `check_private_dir` it."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private_dir(path, what)
    return path


def _read_key(path: Path, what: str) -> bytes:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if os.path.islink(path):
            raise UntrustedPathError(
                f"{what} {path} is a symlink; delete it (a new key is made on next use)"
            ) from None
        raise UntrustedPathError(f"cannot open {what} {path}: {exc}") from None
    try:
        st = os.fstat(fd)
        uid = _uid()
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedPathError(f"{what} {path} is not a regular file; delete it")
        if uid is not None and st.st_uid != uid:
            raise UntrustedPathError(
                f"{what} {path} is owned by uid {st.st_uid}, not by you (uid {uid}): it may "
                "have been planted; delete it (a new key is made on next use)"
            )
        if uid is not None and st.st_mode & 0o077:
            raise UntrustedPathError(
                f"{what} {path} has mode {stat.S_IMODE(st.st_mode):o}, so others may read "
                "or replace it; delete it (a new key is made on next use), or "
                f"`chmod 600 {path}` if nobody else could have seen it"
            )
        key = os.read(fd, 4096)
    finally:
        os.close(fd)
    if len(key) < 16:
        raise UntrustedPathError(
            f"{what} {path} holds {len(key)} bytes; delete it to make a new key"
        )
    return key


def read_or_create_key(path: Path, what: str) -> bytes:
    """The key in ``path``, created (32 random bytes, mode 0600) on first use.

    The folder is checked first (`check_private_dir`), then the key on its open
    descriptor; see [Note: trusting a key on disk]. Creation is atomic: the key is
    written to a private temporary file and linked into place, so two processes that
    race agree on whichever link landed first.
    """
    path = Path(os.path.abspath(path))
    check_private_dir(path.parent, f"the folder of {what}")
    if not os.path.lexists(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".key-")
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.close(fd)
            # link() fails if another process created the key first: theirs wins.
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return _read_key(path, what)
