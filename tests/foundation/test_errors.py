"""Every error cadence raises on purpose is a `cadence.CadenceError` with a builtin base.

The wrappers' misuse errors are exercised in their own tests (each of those bodies
catches only `CadenceError`); here, the class hierarchy and the misuse that needs
no process group.
"""

from __future__ import annotations

import pytest

import cadence
from cadence.data_parallel import DataParallelError
from cadence.errors import CadenceRuntimeError, CadenceTypeError, CadenceValueError
from cadence.fsdp import FullyShardError


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (CadenceValueError, ValueError),
        (CadenceTypeError, TypeError),
        (CadenceRuntimeError, RuntimeError),
        (DataParallelError, RuntimeError),
        (FullyShardError, RuntimeError),
        (cadence.LaunchError, RuntimeError),
    ],
)
def test_each_error_is_a_cadence_error_and_keeps_its_builtin_base(
    error: type[Exception], builtin: type[Exception]
) -> None:
    assert issubclass(error, cadence.CadenceError)
    assert issubclass(error, builtin)


def test_bad_degrees_and_bad_launches_are_cadence_errors() -> None:
    with pytest.raises(CadenceValueError, match="positive int"):
        cadence.Topology(dp_shard=0)
    with pytest.raises(CadenceValueError, match="nprocs"):
        cadence.launch(print, nprocs=0)
    with pytest.raises(CadenceValueError, match="capacity"):
        cadence.EventLog(capacity=0)
