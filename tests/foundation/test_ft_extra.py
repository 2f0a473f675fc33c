"""`cadence.ft` without its extra: one line naming what to install, before anything runs.

Specification: where torchft is not installed (CI's lanes), every entry point of
`cadence.ft` raises `CadenceRuntimeError` naming ``pip install 'cadence[ft]'`` and the
pinned torchft, before it touches the model or a process group. Where it is installed,
``tests/foundation/test_ft.py`` runs instead.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cadence.errors import CadenceRuntimeError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is not None, reason="torchft is installed here"
)


def test_every_entry_point_names_the_extra() -> None:
    from cadence import ft

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = [
        lambda: ft.torchft(),
        lambda: ft.data_parallel(model, manager=None),  # type: ignore[arg-type]
        lambda: ft.optimizer(None, opt),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(CadenceRuntimeError) as info:
            call()
        assert (
            str(info.value)
            == "cadence.ft needs torchft: pip install 'cadence[ft]' (torchft==0.2.0)"
        )
