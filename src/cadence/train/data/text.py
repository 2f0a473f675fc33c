"""Text as tokens: files and folders, the standard library's source, a tokenizer.

Byte-level by default: a text's tokens are its bytes (ids 0-255), memory-mapped, so
nothing is decoded and any encoding trains. With ``--tokenizer FILE.json`` (a
HuggingFace ``tokenizers`` file) each file is decoded as UTF-8 (undecodable bytes
replaced) and encoded with it.

Which files, in which order: a file is itself; a folder is every file below it
whose name does not start with a dot, at any depth, sorted by path relative to the
folder; ``stdlib`` is every ``*.py`` file of this Python's standard library
(``sysconfig.get_paths()["stdlib"]``), third-party folders (``site-packages``,
``dist-packages``) left out, sorted the same way. Empty files add nothing. The same
Python on the same machine gives the same corpus, so a run on it is reproducible.

Torch-free: `cadence.train.preflight` reads the corpus before any rank starts.
"""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from cadence.train._errors import TrainConfigError

__all__ = [
    "BYTE_VOCAB",
    "byte_pieces",
    "load_tokenizer",
    "stdlib_files",
    "text_files",
    "tokenized_pieces",
]

BYTE_VOCAB = 256
_THIRD_PARTY = frozenset({"site-packages", "dist-packages"})


def stdlib_files() -> list[Path]:
    """The ``*.py`` files of this Python's standard library, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = [
        p
        for p in root.rglob("*.py")
        if p.is_file() and not _THIRD_PARTY & set(p.relative_to(root).parts)
    ]
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def text_files(path: Path) -> list[Path]:
    """``path`` itself, or the files below the folder ``path`` (see the module docstring)."""
    if path.is_file():
        return [path]
    found = [
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    return sorted(found, key=lambda p: p.relative_to(path).parts)


def byte_pieces(files: list[Path]) -> list[npt.NDArray[np.uint8]]:
    """Each non-empty file's bytes as a read-only uint8 memory map."""
    pieces: list[npt.NDArray[np.uint8]] = []
    for f in files:
        try:
            if f.stat().st_size:
                pieces.append(np.memmap(f, dtype=np.uint8, mode="r"))
        except OSError as exc:
            raise TrainConfigError(
                f"--data: {f} cannot be read ({exc.strerror}); make it readable or remove it"
            ) from exc
    return pieces


def load_tokenizer(path: str) -> Any:
    """The ``tokenizers.Tokenizer`` in the JSON file ``path``; refuses one that does not load."""
    if importlib.util.find_spec("tokenizers") is None:
        raise TrainConfigError(
            "--tokenizer needs the tokenizers package: pip install tokenizers "
            "(or drop --tokenizer to train byte-level)"
        )
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise TrainConfigError(f"--tokenizer {path}: no such file; give a tokenizer.json")
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises its own Exception for a bad file
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TrainConfigError(
            f"--tokenizer {path} does not load as a tokenizers JSON file ({first}); give the "
            "tokenizer.json that tokenizers' Tokenizer.save wrote"
        ) from exc


def tokenized_pieces(files: list[Path], tokenizer: Any) -> list[npt.NDArray[np.uint32]]:
    """Each non-empty file's text encoded with ``tokenizer``, as uint32 ids."""
    pieces: list[npt.NDArray[np.uint32]] = []
    for f in files:
        try:
            text = f.read_bytes().decode("utf-8", errors="replace")
        except OSError as exc:
            raise TrainConfigError(
                f"--data: {f} cannot be read ({exc.strerror}); make it readable or remove it"
            ) from exc
        ids = tokenizer.encode(text).ids
        if ids:
            pieces.append(np.asarray(ids, dtype=np.uint32))
    return pieces
