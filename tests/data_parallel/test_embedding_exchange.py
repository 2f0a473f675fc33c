"""`EmbeddingExchange`: an embedding's gradient exchanged as its lookups. Worlds 1 and 2.

- Parity: for EmbeddingBag (mean and sum, sparse and dense, 2-D input, offsets with
  and without the last one, an empty bag, ``padding_idx``, per-sample weights) and
  Embedding (sparse and dense, ``padding_idx``), ranks looking up different numbers
  of ids: each step's gradient and the weights after three SGD steps equal one
  process's on the concatenated batch; a sparse bag's weights equal torch DDP's.
- Counts and order: one 16-byte size gather per forward, one packed gather issued in
  backward and waited in ``finalize``, under a tenth of the sparse rows' bytes for
  bags of 16; world 1 issues none.
- The async handle, micro-batch accumulation, an existing ``.grad``, ``no_grad``
  forwards, ``remove()``; refusals name cause and fix, before any collective; a
  peer's corrupt lookups are refused naming the rank.

The scenarios, with their assertions, are in ``bodies_embedding``.
"""

from __future__ import annotations

import pytest

from tests._scenarios import Outcomes, check, launched, names
from tests.data_parallel.bodies_embedding import SCENARIOS


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_embedding_exchange_world2(world2: dict[str, Outcomes], name: str) -> None:
    check(world2["embedding"], name)


@pytest.fixture(scope="module")
def world1() -> Outcomes:
    return launched("tests.data_parallel.bodies_embedding", world_size=1, timeout=120)


@pytest.mark.parametrize("name", names(SCENARIOS))
def test_embedding_exchange_world1(world1: Outcomes, name: str) -> None:
    check(world1, name)
