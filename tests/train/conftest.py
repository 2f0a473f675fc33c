"""Setup shared by the ``cadence train`` tests.

Every checkpoint these tests write is signed with a key in a private temporary folder
(``CADENCE_CHECKPOINT_KEY_FILE``), never with the user's own key under
``~/.config/cadence``: a test must not create or read files in the real home.

The fixture is session-scoped so that it is in place before any module-scoped
fixture trains (pytest sets up wider scopes first). It sets ``os.environ`` itself,
so the ranks that `cadence.launch` spawns and the workers torchrun starts inherit it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

KEY_ENV = "CADENCE_CHECKPOINT_KEY_FILE"


@pytest.fixture(scope="session", autouse=True)
def checkpoint_key_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The key file every test's checkpoints are signed with (created on first use)."""
    folder = tmp_path_factory.mktemp("checkpoint-key")
    # The key's folder must be writable by this user only (see cadence._util.owned).
    os.chmod(folder, 0o700)
    path = folder / "checkpoint.key"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KEY_ENV, str(path))
        yield path
