"""The behaviour table in docs/pickling.md is measured, not typed: it must equal what
``tests/pickling/_matrix.py`` measures now (cadence, and the pinned cloudpickle and
dill). After a deliberate change, regenerate it with
``python -m tests.pickling._matrix --write``."""

from __future__ import annotations

import pytest

pytest.importorskip("cloudpickle")
pytest.importorskip("dill")
pytest.importorskip("torch")


def test_docs_table_is_the_measured_one():
    from tests.pickling import _matrix

    measured = _matrix.table()
    assert measured == _matrix.docs_table(), (
        "docs/pickling.md's behaviour table differs from the measurement; if the change "
        "is intended run: python -m tests.pickling._matrix --write\n\n" + measured
    )
