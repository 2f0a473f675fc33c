"""A precompile cache is used only when its owner alone controls it.

Specification (see [Note: precompile cache key file] and the threat model in
docs/precompile.md):
- a cache directory that others may write, planted with someone else's key and an
  artifact validly signed with it, is never read: ``precompile`` raises
  `UntrustedPathError` naming the folder and the fix, nothing is unpickled, nothing is
  compiled and nothing is written there;
- a key renamed away and replaced in a cache directory of mode 0777 is refused the same
  way, and so is a whole cache directory replaced under a parent that others may write
  without the sticky bit; under a sticky parent (``/tmp``) a private cache works;
- a key that is a symlink, not a regular file, readable or writable by group or others,
  or owned by another user is refused, with the fix (delete it, a new key is made);
- a cache directory owned by another user, or writable by its group, is refused;
- `ArtifactCache` itself refuses all of these, so nothing else that opens a cache can
  skip the checks;
- control: the planted artifact *is* unpickled when its signing key is the trusted
  cache's own, so the refusals above are what keeps it from running.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest

import cadence
from cadence.errors import CadenceError, UntrustedPathError
from cadence.precompiling import CacheRefusedWarning, _artifact, _job, _torch_aot, stats
from tests.precompiling import _bodies
from tests.precompiling._bodies import BACKEND, Boom, inputs, step

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX ownership only"),
    pytest.mark.filterwarnings("ignore:Cannot locate reference"),
]

OPTIONS = {"backend": BACKEND, "dynamic": None, "mode": None, "options": None}
ATTACKER_KEY = b"k" * 32
NOBODY = 65534


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A private folder to put caches in (the tests' own tmp folders are private too)."""
    os.chmod(tmp_path, 0o700)
    return tmp_path


def _plant(directory: Path, key: bytes = ATTACKER_KEY, *, key_file: bool = True) -> None:
    """What an attacker leaves: their key (mode 0600) and an artifact for `step` with the
    example inputs, signed with that key, whose payload sets FLAG when unpickled."""
    directory.mkdir(exist_ok=True)
    if key_file:
        (directory / _artifact.KEY_FILE).write_bytes(key)
        os.chmod(directory / _artifact.KEY_FILE, 0o600)
    model, x, y = inputs()
    cache_key, _ = _job.Job(step, OPTIONS, None).key((model, x, y), {})
    payload = _torch_aot.payload_header() + pickle.dumps(Boom())
    data = _artifact.encode(_artifact.make_header(cache_key), {"artifact": payload}, key)
    (directory / cache_key.filename()).write_bytes(data)


def _listing(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _refused(cache: Path, match: str, loads: list[int]) -> UntrustedPathError:
    """``precompile`` with ``cache`` raises, and reads, runs, compiles and writes nothing."""
    before = stats()
    listing = _listing(cache) if cache.is_dir() and not cache.is_symlink() else None
    model, x, y = inputs()
    with pytest.raises(UntrustedPathError, match=match) as info:
        cadence.precompile(step, (model, x, y), cache_dir=cache, backend=BACKEND)
    assert _bodies.FLAG == [], "the planted payload was unpickled"
    assert loads == [], "torch's loader ran"
    assert stats()["compiles"] == before["compiles"]
    assert stats()["cache_writes"] == before["cache_writes"]
    if listing is not None:
        assert _listing(cache) == listing, "something was written into the untrusted folder"
    with pytest.raises(UntrustedPathError, match=match):
        _artifact.ArtifactCache(cache)
    assert isinstance(info.value, (CadenceError, PermissionError))
    return info.value


def test_a_planted_cache_directory_others_may_write_is_never_read(
    home: Path, loads: list[int]
) -> None:
    cache = home / "shared-cache"
    cache.mkdir()
    os.chmod(cache, 0o777)  # made by someone else, so that the victim can write into it
    _plant(cache)
    _refused(cache, rf"writable by others \(mode 777\); run `chmod go-w {cache}`", loads)


def test_nothing_is_created_in_an_empty_folder_others_may_write(
    home: Path, loads: list[int]
) -> None:
    cache = home / "empty"
    cache.mkdir()
    os.chmod(cache, 0o777)
    _refused(cache, "writable by others", loads)
    assert list(cache.iterdir()) == []  # no key was made there either


def test_a_key_renamed_away_and_replaced_in_a_folder_of_mode_0777_is_refused(
    home: Path, loads: list[int]
) -> None:
    cache = home / "cache"
    _artifact.ArtifactCache(cache)  # the victim's own key, unreadable to anyone else
    os.chmod(cache, 0o777)
    os.rename(cache / _artifact.KEY_FILE, cache / "moved-away")
    _plant(cache)
    _refused(cache, "writable by others", loads)


def test_a_cache_replaced_under_a_parent_others_may_write_is_refused(
    home: Path, loads: list[int]
) -> None:
    shared = home / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # no sticky bit: anyone may rename the victim's folder
    cache = shared / "cache"
    _plant(cache)  # in place of the victim's folder, mode 0700 like the real one
    os.chmod(cache, 0o700)
    _refused(cache, f"lies under {shared}, which others may write without the sticky", loads)


def test_a_private_cache_under_a_sticky_shared_parent_works(home: Path) -> None:
    shared = home / "tmp-like"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp: only an entry's owner may rename it
    cache = _artifact.ArtifactCache(shared / "cache")
    assert cache.directory == shared / "cache" and len(cache.key) == 32


def test_a_symlinked_key_is_refused(home: Path, loads: list[int]) -> None:
    cache = home / "cache"
    _plant(cache, key_file=False)
    os.chmod(cache, 0o700)
    elsewhere = home / "attacker-key"
    elsewhere.write_bytes(ATTACKER_KEY)
    os.chmod(elsewhere, 0o600)
    (cache / _artifact.KEY_FILE).symlink_to(elsewhere)
    _refused(cache, "is a symlink; delete it", loads)


def test_a_key_others_may_read_is_refused(home: Path, loads: list[int]) -> None:
    cache = home / "cache"
    _plant(cache)
    os.chmod(cache, 0o700)
    os.chmod(cache / _artifact.KEY_FILE, 0o644)
    _refused(cache, r"has mode 644, so others may read or replace it; delete it", loads)


def test_a_key_that_is_not_a_regular_file_is_refused(home: Path, loads: list[int]) -> None:
    cache = home / "cache"
    _plant(cache, key_file=False)
    os.chmod(cache, 0o700)
    (cache / _artifact.KEY_FILE).mkdir()
    _refused(cache, "is not a regular file; delete it", loads)


def test_a_cache_directory_its_group_may_write_is_refused(home: Path, loads: list[int]) -> None:
    cache = home / "cache"
    _plant(cache)
    os.chmod(cache, 0o770)
    _refused(cache, r"writable by others \(mode 770\)", loads)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_key_owned_by_another_user_is_refused(home: Path, loads: list[int]) -> None:
    cache = home / "cache"
    _plant(cache)
    os.chmod(cache, 0o700)
    os.chown(cache / _artifact.KEY_FILE, NOBODY, NOBODY)
    _refused(cache, f"owned by uid {NOBODY}, not by you .* delete it", loads)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_cache_directory_owned_by_another_user_is_refused(home: Path, loads: list[int]) -> None:
    cache = home / "cache"
    _plant(cache)
    os.chmod(cache, 0o700)
    os.chown(cache, NOBODY, NOBODY)
    _refused(cache, f"owned by uid {NOBODY}, not by you .* use a folder you own", loads)


def test_control_the_planted_artifact_runs_when_signed_with_the_trusted_key(
    home: Path, loads: list[int]
) -> None:
    cache = home / "cache"
    trusted = _artifact.ArtifactCache(cache)
    _plant(cache, trusted.key, key_file=False)
    model, x, y = inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CacheRefusedWarning)
        compiled = cadence.precompile(step, (model, x, y), cache_dir=cache, backend=BACKEND)
    assert _bodies.FLAG == ["unpickled"] and len(loads) == 1
    assert compiled.source == "compiled"  # the booby trap is not a function: compiled instead
    assert any("failed to load" in str(w.message) for w in caught)
