"""``--data``, resolved: the tokens a run trains on, the ones it holds out, and the
vocabulary they need; each problem refused in one line before any rank starts.

What ``--data`` names (see docs/train.md, "Your data"):

- ``stdlib``: the Python standard library's source, byte-level (`text.stdlib_files`);
- a ``.bin`` file, or a folder holding ``.bin`` files: token shards (`shards`), every
  ``.bin`` below the folder in sorted order, read as one stream;
- any other file or folder: text (`text`), byte-level or with ``--tokenizer``.

[Note: the held-out tokens]
The last ``--val-fraction`` of the stream (default 1%, rounded down to whole tokens)
is held out: training windows are drawn from the tokens before it and evaluation
windows from it, so no held-out token is ever trained on. A window is
``seq_len + 1`` tokens (inputs and their next-token targets), so each part must hold
at least one, and the training part one rank's share of a batch (the rows a
data-parallel replica takes), or the run is refused.

[Note: the vocabulary a corpus needs]
Byte-level text needs 256 ids whatever bytes it holds; a tokenizer needs its
vocabulary size; shards need their largest id + 1, found by one pass over every
shard (`shards.shard_max`: exact, at disk speed, once per command). The model's
``vocab_size`` must cover it; ``cadence train --data`` without ``--vocab-size`` (or a
config file's ``vocab_size``) takes it as the model's.

Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cadence.train._errors import TrainConfigError
from cadence.train.config import TrainConfig
from cadence.train.data.shards import open_shard, shard_max
from cadence.train.data.stream import TokenStream
from cadence.train.data.text import (
    BYTE_VOCAB,
    byte_pieces,
    load_tokenizer,
    stdlib_files,
    text_files,
    tokenized_pieces,
)

__all__ = [
    "DEFAULT_VAL_FRACTION",
    "STDLIB",
    "Corpus",
    "check_corpus",
    "data_vocab",
    "open_corpus",
]

STDLIB = "stdlib"
DEFAULT_VAL_FRACTION = 0.01


@dataclass(frozen=True)
class Corpus:
    """The tokens of ``--data``, split (see [Note: the held-out tokens])."""

    train: TokenStream
    val: TokenStream
    kind: str
    """``stdlib``, ``shards`` or ``text``."""
    what: str
    """What was read, for messages: ``3 shards (uint16)``."""
    vocab: int
    """The vocabulary the corpus needs (see [Note: the vocabulary a corpus needs])."""

    def __len__(self) -> int:
        return len(self.train) + len(self.val)


def _kind(data: str) -> tuple[str, list[Path]]:
    """What ``--data`` names, and its files (shards or text) in order."""
    if data == STDLIB:
        return STDLIB, stdlib_files()
    path = Path(data)
    if not path.exists():
        raise TrainConfigError(
            f"--data {data}: no such file or folder; give token shards (.bin), text files, "
            f"or {STDLIB} (the Python standard library's source)"
        )
    if path.is_file():
        return ("shards" if path.suffix == ".bin" else "text"), [path]
    shards = sorted(
        (p for p in path.rglob("*.bin") if p.is_file()), key=lambda p: p.relative_to(path).parts
    )
    if shards:
        return "shards", shards
    files = text_files(path)
    if not files:
        raise TrainConfigError(f"--data {data}: the folder holds no files; give a folder of data")
    return "text", files


def open_corpus(
    data: str, *, dtype: str = "", tokenizer: str = "", val_fraction: float | None = None
) -> Corpus:
    """Read ``--data`` (memory maps for shards and byte-level text) and split it."""
    kind, files = _kind(data)
    if kind == "shards":
        if tokenizer:
            raise TrainConfigError(
                f"--tokenizer applies to text, but --data {data} is token shards (.bin), "
                "already tokenized; drop --tokenizer"
            )
        read = [open_shard(f, dtype) for f in files]
        pieces = [s.tokens for s in read]
        kinds = sorted({s.dtype + (", llm.c header" if s.llmc else "") for s in read})
        what = f"{len(read)} shard{'s' * (len(read) != 1)} ({'; '.join(kinds)})"
        vocab = max(shard_max(s) for s in read) + 1
    else:
        if dtype:
            raise TrainConfigError(
                f"--data-dtype applies to token shards (.bin), but --data {data} is text; "
                "drop --data-dtype"
            )
        if tokenizer:
            tok = load_tokenizer(tokenizer)
            pieces, vocab = tokenized_pieces(files, tok), int(tok.get_vocab_size())
            how = f"tokenized with {tokenizer}"
        else:
            pieces, vocab, how = byte_pieces(files), BYTE_VOCAB, "byte-level"
        source = " of the Python standard library" if kind == STDLIB else ""
        what = f"{len(files)} file{'s' * (len(files) != 1)}{source}, {how}"
    whole = TokenStream(pieces)
    frac = DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction
    held = int(len(whole) * frac)
    cut = len(whole) - held
    return Corpus(whole.slice(0, cut), whole.slice(cut, len(whole)), kind, what, vocab)


def corpus_of(cfg: TrainConfig) -> Corpus:
    """`open_corpus` with ``cfg``'s data options."""
    return open_corpus(
        cfg.data, dtype=cfg.data_dtype, tokenizer=cfg.tokenizer, val_fraction=cfg.val_fraction
    )


def data_vocab(data: str, *, dtype: str = "", tokenizer: str = "") -> int:
    """The vocabulary ``--data`` needs (see [Note: the vocabulary a corpus needs])."""
    if data == STDLIB and not tokenizer:
        return BYTE_VOCAB  # no need to map 1800 files to know it
    return open_corpus(data, dtype=dtype, tokenizer=tokenizer).vocab


def check_corpus(cfg: TrainConfig, world: int) -> Corpus:
    """``cfg``'s corpus, or a `TrainConfigError` naming what does not fit: a vocabulary
    above the model's, a training part shorter than one rank's share of a batch, a
    held-out part shorter than one window."""
    corpus = corpus_of(cfg)
    model = cfg.model
    if corpus.vocab > model.vocab_size:
        need = f"ids up to {corpus.vocab - 1}" if corpus.kind == "shards" else f"{corpus.vocab} ids"
        raise TrainConfigError(
            f"--data {cfg.data} ({corpus.what}) needs {need}, but the model's vocab_size is "
            f"{model.vocab_size}: use --vocab-size {corpus.vocab} or more"
        )
    window = model.seq_len + 1
    rows = cfg.batch_size // cfg.layout(world).dp
    if len(corpus.train) < rows * window:
        raise TrainConfigError(
            f"--data {cfg.data} ({corpus.what}) has {len(corpus.train)} training tokens, fewer "
            f"than one rank's {rows} rows x {window} tokens (seq_len + 1) = {rows * window}: "
            "give more data, or a smaller --batch-size or [train.model] seq_len"
        )
    if len(corpus.val) < window:
        frac = DEFAULT_VAL_FRACTION if cfg.val_fraction is None else cfg.val_fraction
        raise TrainConfigError(
            f"--data {cfg.data} ({corpus.what}): the held-out {frac:g} of its {len(corpus)} "
            f"tokens is {len(corpus.val)} tokens, fewer than one window of {window} (seq_len "
            f"+ 1); raise --val-fraction to {min(0.5, 2 * window / max(len(corpus), 1)):.3g} "
            "or give more data"
        )
    return corpus
