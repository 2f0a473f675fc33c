"""Bad artifacts are refused before a byte is unpickled, with a warning, then recompiled.

"Before unpickling" is proved twice: the forged artifacts carry a payload that sets a flag
when unpickled (a control shows that it does), and the loader is wrapped with a counter.
"""

from __future__ import annotations

import os
import pickle
import stat
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import cadence
from cadence.precompiling import CacheRefusedWarning, _artifact, _torch_aot, stats
from cadence.testing import assert_close
from tests.precompiling import _bodies
from tests.precompiling._bodies import BACKEND, Boom, inputs, loss_and_grads, step

pytestmark = pytest.mark.filterwarnings("ignore:Cannot locate reference")


def _precompile(cache: Path, fn: Callable[..., Any] = step) -> Any:
    model, x, y = inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CacheRefusedWarning)
        compiled = cadence.precompile(fn, (model, x, y), cache_dir=cache, backend=BACKEND)
    refused = [str(w.message) for w in caught if w.category is CacheRefusedWarning]
    assert_close(loss_and_grads(compiled, model, x, y), loss_and_grads(fn, model, x, y))
    return compiled, refused


def _forge(path: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> bytes:
    """The artifact at ``path`` with a booby-trapped payload, re-signed with the cache key."""
    key = (path.parent / _artifact.KEY_FILE).read_bytes()
    header, _ = _artifact.decode(path.read_bytes(), key)
    if edit is not None:
        edit(header["key"])
    header.pop("sections")
    # torch's own header in front, so that torch's loader does reach the pickle.
    payload = _torch_aot.payload_header() + pickle.dumps(Boom())
    return _artifact.encode(header, {"artifact": payload}, key)


def _set(*path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(fields: dict[str, Any]) -> None:
        for part in path[:-1]:
            fields = fields[part]
        fields[path[-1]] = value

    return edit


def test_bad_artifacts_are_refused_before_unpickling(tmp_path: Path, loads: list[int]) -> None:
    cache = tmp_path / "cache"
    compiled, refused = _precompile(cache)
    assert compiled.source == "compiled" and not refused and loads == []
    path = Path(compiled.cache_path)
    key_file = cache / _artifact.KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert [p.name for p in cache.iterdir() if p.name.startswith(".tmp-")] == []

    # Control: a forged payload with a valid header IS unpickled, and sets the flag.
    path.write_bytes(_forge(path))
    compiled, refused = _precompile(cache)
    assert _bodies.FLAG == ["unpickled"] and len(loads) == 1
    assert compiled.source == "compiled" and "failed to load" in refused[0]
    _bodies.FLAG.clear()

    source_name = next(
        iter(_artifact.decode(path.read_bytes(), key_file.read_bytes())[0]["key"]["sources"])
    )
    cases = {
        "corrupt": lambda: _flip(_forge(path)),
        "truncated": lambda: _forge(path)[:-100],
        "wrong version": lambda: _forge(path, _set("env", "torch", value="0.0.1")),
        "edited source": lambda: _forge(path, _set("sources", source_name, value="0" * 32)),
    }
    expected = {
        "corrupt": "corrupt: the signature does not verify",
        "truncated": "corrupt: ",
        "wrong version": 'incompatible: env.torch: artifact "0.0.1"',
        "edited source": f"stale: source of {source_name} changed",
    }
    for case, make in cases.items():
        path.write_bytes(make())
        before, seen = stats()["compiles"], len(loads)
        compiled, refused = _precompile(cache)
        assert _bodies.FLAG == [], case
        assert len(loads) == seen, f"{case}: the loader ran"
        assert len(refused) == 1 and expected[case] in refused[0], (case, refused)
        assert compiled.source == "compiled" and stats()["compiles"] == before + 1, case

    # After the last refusal the artifact was rewritten: the next call hits it.
    compiled, refused = _precompile(cache)
    assert compiled.source == "cache" and not refused and _bodies.FLAG == []


def _flip(data: bytes) -> bytes:
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]


def test_another_caches_key_is_refused(tmp_path: Path) -> None:
    ours, theirs = _artifact.ArtifactCache(tmp_path / "a"), _artifact.ArtifactCache(tmp_path / "b")
    data = _artifact.encode({"key": {}}, {"artifact": b"x"}, theirs.key)
    with pytest.raises(_artifact.ArtifactRefused, match="signed with another cache's key"):
        _artifact.decode(data, ours.key)
    with pytest.raises(_artifact.ArtifactRefused, match="bad magic"):
        _artifact.decode(b"P" * 100, ours.key)
    with pytest.raises(_artifact.ArtifactRefused, match="format 7"):
        _artifact.decode(data[:8] + b"\x00\x07" + data[10:], ours.key)
    assert _artifact.decode(data, theirs.key)[1] == {"artifact": b"x"}


def test_an_edited_function_is_compiled_again_never_run_stale(tmp_path: Path) -> None:
    """Same module and qualname, different body: the old artifact is refused by name."""

    def make(factor: float) -> Any:
        source = f"def step(model, x, y):\n    return ((model(x) * {factor} - y) ** 2).mean()\n"
        namespace: dict[str, Any] = {"__name__": "tests.precompiling.edited"}
        exec(compile(source, "edited.py", "exec"), namespace)
        fn = namespace["step"]
        assert isinstance(fn, types.FunctionType)
        return fn

    cache = tmp_path / "cache"
    first, refused = _precompile(cache, make(2.0))
    assert first.source == "compiled" and not refused
    second, refused = _precompile(cache, make(5.0))  # loss_and_grads checks the new code
    assert second.source == "compiled"
    assert (
        len(refused) == 1
        and "stale: source of tests.precompiling.edited.step changed" in refused[0]
    )
    assert os.path.exists(second.cache_path) and second.cache_path == first.cache_path
