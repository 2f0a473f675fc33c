"""``cadence train --data``: the readers, the batches of each step, the held-out tokens.

Specification (in-process, no process group):
- the batch of step N is a function of (seed, N): the same from a fresh reader as
  after any other batches (a resumed run reads what an unbroken one did), and the
  same on every rank;
- each data-parallel replica's rows (`Topology.local_slice`) at dp 1, 2 and 4 are
  disjoint and, in rank order, make up the global batch;
- no training window reaches into the held-out tokens, and every evaluation window
  lies inside them;
- nanoGPT's flat uint16 files, llm.c's headered files (GPT-2 uint16 and LLaMA 3
  uint32) and a folder of shards read as the same token stream; a window may cross
  from one shard into the next;
- ``stdlib`` is the standard library's ``*.py`` files, sorted, byte-level, the same
  twice.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cadence.topology import Topology
from cadence.train.data.corpus import open_corpus
from cadence.train.data.shards import LLMC_HEADER_BYTES
from cadence.train.data.text import stdlib_files
from cadence.train.data.windows import TokenWindows


def write_nanogpt(path: Path, tokens: np.ndarray, dtype: str = "uint16") -> Path:
    tokens.astype(dtype).tofile(path)
    return path


def write_llmc(path: Path, tokens: np.ndarray, magic: int = 20240520) -> Path:
    """A shard as llm.c's dev/data/data_common.py writes it."""
    version, dtype = {20240520: (1, np.uint16), 20240801: (7, np.uint32)}[magic]
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, version, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype).tobytes())
    return path


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    """Token i is i % 60000: a token's value says where it came from."""
    return write_nanogpt(tmp_path / "train.bin", np.arange(20_000) % 60_000)


def test_the_batch_of_a_step_depends_on_seed_and_step_only(shard: Path) -> None:
    corpus = open_corpus(str(shard))
    a, b = TokenWindows(corpus, 16, seed=3), TokenWindows(corpus, 16, seed=3)
    for step in range(7):
        a.batch(step, 8)  # a run that went through steps 0..6
    x, y = a.batch(7, 8)
    x2, y2 = b.batch(7, 8)  # a restart that asks for step 7 at once
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert not torch.equal(x, TokenWindows(corpus, 16, seed=4).batch(7, 8)[0])
    assert not torch.equal(x, a.batch(8, 8)[0])


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_each_replica_takes_its_own_rows_of_the_global_batch(shard: Path, dp: int) -> None:
    windows = TokenWindows(open_corpus(str(shard)), 16, seed=0)
    topo = Topology(dp_replicate=dp)
    x, _ = windows.batch(5, 8)
    slices = [topo.local_slice(r, 8) for r in range(dp)]
    rows = [set(range(s.start, s.stop)) for s in slices]
    for i in range(dp):
        for j in range(i + 1, dp):
            assert not rows[i] & rows[j]
    assert torch.equal(torch.cat([x[s] for s in slices]), x)
    assert sum(len(r) for r in rows) == 8


def test_no_training_window_reaches_the_held_out_tokens(shard: Path) -> None:
    corpus = open_corpus(str(shard), val_fraction=0.1)
    assert (len(corpus.train), len(corpus.val)) == (18_000, 2_000)
    windows = TokenWindows(corpus, 32, seed=0)
    # Token values are positions: training tokens are < 18000, held-out ones >= 18000.
    seen_last = 0
    for step in range(300):
        x, y = windows.batch(step, 16)
        assert int(y.max()) < 18_000
        seen_last = max(seen_last, int(y.max()))
    assert seen_last > 17_500  # windows do reach the end of the training part
    for j in range(4):
        x, y = windows.val_batch(j, 16)
        assert int(x.min()) >= 18_000 and int(y.max()) < 20_000
    assert torch.equal(windows.val_batch(1, 16)[0], windows.val_batch(1, 16)[0])


def test_nanogpt_and_llmc_shards_read_alike(tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, 50_257, 5_000)
    flat = write_nanogpt(tmp_path / "flat.bin", tokens)
    gpt2 = write_llmc(tmp_path / "gpt2.bin", tokens)
    llama = write_llmc(tmp_path / "llama.bin", tokens + 70_000, magic=20240801)
    wide = write_nanogpt(tmp_path / "wide.bin", tokens + 70_000, "uint32")
    read = {p.name: open_corpus(str(p)) for p in (flat, gpt2, llama)}
    read["wide.bin"] = open_corpus(str(wide), dtype="uint32")
    assert len(open_corpus(str(wide))) == 10_000  # without the flag: uint16, twice as many
    assert read["flat.bin"].what == "1 shard (uint16)"
    assert "uint16, llm.c header" in read["gpt2.bin"].what
    assert "uint32, llm.c header" in read["llama.bin"].what
    assert gpt2.stat().st_size == LLMC_HEADER_BYTES + 2 * 5_000
    for name, c in read.items():
        assert len(c) == 5_000
        offset = 70_000 if name in ("llama.bin", "wide.bin") else 0
        assert np.array_equal(c.train.read(0, len(c.train)), tokens[: len(c.train)] + offset)
        assert c.vocab == int(tokens.max()) + 1 + offset


def test_a_folder_of_shards_is_one_stream(tmp_path: Path) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    write_llmc(folder / "b_000001.bin", np.arange(100, 200))
    write_nanogpt(folder / "a_000000.bin", np.arange(0, 100))
    (folder / "README.txt").write_text("not a shard: ignored")
    corpus = open_corpus(str(folder), val_fraction=0.1)
    assert corpus.what.startswith("2 shards")
    assert np.array_equal(corpus.train.read(95, 10), np.arange(95, 105))  # crosses shards
    assert np.array_equal(corpus.val.read(0, 20), np.arange(180, 200))


def test_stdlib_is_the_standard_library_byte_level_and_deterministic() -> None:
    files = stdlib_files()
    assert files and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    corpus = open_corpus("stdlib")
    assert corpus.vocab == 256 and len(corpus) == sum(f.stat().st_size for f in files)
    first = next(f for f in files if f.stat().st_size)
    assert bytes(corpus.train.read(0, 64).astype(np.uint8)) == first.read_bytes()[:64]
    again = TokenWindows(open_corpus("stdlib"), 32, seed=0).batch(3, 4)[0]
    assert torch.equal(TokenWindows(corpus, 32, seed=0).batch(3, 4)[0], again)
    assert len(corpus.val) == len(corpus) // 100
