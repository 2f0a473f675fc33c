"""Keys on disk are trusted only when the current user alone controls them.

Specification (`cadence._util.owned`, see [Note: trusting a key on disk]):
- a missing key is created: 32 random bytes, a regular file of mode 0600;
- two folders get two keys, and the same folder gives the same key back;
- a key that is a symlink, is not a regular file, is readable or writable by group or
  others, or is too short is refused, and nothing is read from it;
- a folder that others may write, or that is a symlink, is refused before a key is
  created or read in it;
- a folder below a folder that others may write without the sticky bit is refused
  (they could rename it away); below a sticky one (``/tmp``) it is accepted;
- every refusal is an `UntrustedPathError` (a ``PermissionError``) naming the path and
  the fix.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cadence._util.owned import check_private_dir, read_or_create_key
from cadence.errors import UntrustedPathError

pytestmark = [
    pytest.mark.torch_free,
    pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX ownership only"),
]


@pytest.fixture
def private(tmp_path: Path) -> Path:
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    return folder


def test_a_missing_key_is_created_private_and_read_back(private: Path) -> None:
    key = read_or_create_key(private / "k", "the test key")
    st = os.lstat(private / "k")
    assert len(key) == 32 and stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert read_or_create_key(private / "k", "the test key") == key
    other = private / "other"
    other.mkdir(mode=0o700)
    assert read_or_create_key(other / "k", "the test key") != key


def test_a_symlinked_key_is_refused(private: Path, tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    planted.write_bytes(b"x" * 32)
    os.chmod(planted, 0o600)
    (private / "k").symlink_to(planted)
    with pytest.raises(UntrustedPathError, match="symlink; delete it"):
        read_or_create_key(private / "k", "the test key")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o666])
def test_a_key_others_may_read_or_write_is_refused(private: Path, mode: int) -> None:
    read_or_create_key(private / "k", "the test key")
    os.chmod(private / "k", mode)
    with pytest.raises(UntrustedPathError, match=f"mode {mode:o}.*delete it"):
        read_or_create_key(private / "k", "the test key")


def test_a_key_that_is_a_folder_or_too_short_is_refused(private: Path) -> None:
    (private / "k").mkdir()
    with pytest.raises(UntrustedPathError, match="not a regular file"):
        read_or_create_key(private / "k", "the test key")
    (private / "short").write_bytes(b"abc")
    os.chmod(private / "short", 0o600)
    with pytest.raises(UntrustedPathError, match="holds 3 bytes"):
        read_or_create_key(private / "short", "the test key")


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o707])
def test_a_folder_others_may_write_is_refused_before_any_key(private: Path, mode: int) -> None:
    os.chmod(private, mode)
    with pytest.raises(UntrustedPathError, match=rf"writable by others.*chmod go-w {private}"):
        read_or_create_key(private / "k", "the test key")
    assert not (private / "k").exists()  # nothing was created there either


def test_a_symlinked_folder_is_refused(private: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(private)
    with pytest.raises(UntrustedPathError, match="is a symlink; pass the real folder"):
        check_private_dir(link, "the test folder")


def test_a_folder_under_a_shared_folder_needs_the_sticky_bit(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    mine = shared / "mine"
    mine.mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path, 0o700)
    os.chmod(shared, 0o777)
    with pytest.raises(UntrustedPathError, match="without the sticky bit"):
        check_private_dir(mine, "the test folder")
    os.chmod(shared, 0o1777)  # like /tmp: only an entry's owner may rename it
    check_private_dir(mine, "the test folder")
    assert issubclass(UntrustedPathError, PermissionError)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_key_or_folder_owned_by_another_user_is_refused(private: Path) -> None:
    nobody = 65534
    read_or_create_key(private / "k", "the test key")
    os.chown(private / "k", nobody, nobody)
    with pytest.raises(UntrustedPathError, match=f"owned by uid {nobody}, not by you"):
        read_or_create_key(private / "k", "the test key")
    os.chown(private, nobody, nobody)
    with pytest.raises(UntrustedPathError, match=f"owned by uid {nobody}, not by you"):
        check_private_dir(private, "the test folder")
