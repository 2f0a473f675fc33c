"""`cadence.ft` without its extra: one line naming what to install, before anything runs.

Specification: where torchft cannot be imported (here: hidden from the import system,
so the check runs whether or not the dev install has it), every entry point of
`cadence.ft` raises `CadenceRuntimeError` naming ``pip install 'cadence[ft]'`` and the
pinned torchft, before it touches the model or a process group.
"""

from __future__ import annotations

import sys

import pytest
import torch

from cadence.errors import CadenceRuntimeError


def test_every_entry_point_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from cadence import ft

    # A None entry makes `import torchft` raise ImportError, as where it is not installed.
    for name in [m for m in sys.modules if m == "torchft" or m.startswith("torchft.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchft", None)
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
        assert str(info.value) == (
            "cadence.ft needs torchft: pip install 'cadence[ft]' (torchft==0.2.0)"
        )
