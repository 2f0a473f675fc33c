"""torch's own DDP tests (``distributed_test.py`` of the installed wheel), as torch's
``test/distributed/test_distributed_spawn.py`` runs them, optionally with
``DistributedDataParallel`` replaced by `cadence.DataParallel` in every rank.

Not a pytest module (no ``test_`` prefix): ``test_torch_ddp_suite.py`` runs it with
``python -m unittest`` in a subprocess per mode, so that torch's environment variables
(``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR``), which ``distributed_test.py`` reads when it is
imported, are set before it is, and so that each rank process, which re-imports this
module to find its test, applies the same replacement.

``CADENCE_TORCH_SUITE=cadence`` replaces DDP; anything else (or unset) runs torch's own.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

# Before distributed_test.py is imported: it reads these at import.
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="cadence-torch-suite-")
os.makedirs(os.path.join(os.environ["TEMP_DIR"], "barrier"), exist_ok=True)

import torch  # noqa: E402
import torch.nn.parallel  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402

WRAPPER = os.environ.get("CADENCE_TORCH_SUITE", "torch")

if WRAPPER == "cadence":
    from cadence.data_parallel import DataParallel

    # Every spelling distributed_test.py uses: nn.parallel.DistributedDataParallel,
    # torch.nn.parallel.DistributedDataParallel, and its own imported name.
    torch.nn.parallel.DistributedDataParallel = DataParallel  # type: ignore[misc]
    distributed_test.DistributedDataParallel = DataParallel  # type: ignore[misc]


class TestDDPSuite(
    distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase
):
    """torch's test class, spawning its ranks per test as test_distributed_spawn.py."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


def run(names: list[str]) -> dict[str, dict[str, str]]:
    """Run ``names`` of `TestDDPSuite`; per test its outcome ("ok", "skipped", "fail",
    "error") and detail (the skip reason, or the failure's last lines)."""
    import unittest

    out: dict[str, dict[str, str]] = {}

    class Result(unittest.TestResult):
        def addSuccess(self, test: unittest.TestCase) -> None:
            out[test._testMethodName] = {"outcome": "ok", "detail": ""}

        def addSkip(self, test: unittest.TestCase, reason: str) -> None:
            out[test._testMethodName] = {"outcome": "skipped", "detail": reason}

        def addFailure(self, test: unittest.TestCase, err: Any) -> None:
            detail = self._exc_info_to_string(err, test).strip().splitlines()[-3:]
            out[test._testMethodName] = {"outcome": "fail", "detail": "\n".join(detail)}

        def addError(self, test: unittest.TestCase, err: Any) -> None:
            detail = self._exc_info_to_string(err, test).strip().splitlines()[-3:]
            out[test._testMethodName] = {"outcome": "error", "detail": "\n".join(detail)}

    suite = unittest.TestSuite(TestDDPSuite(name) for name in names)
    suite.run(Result())
    return out


if __name__ == "__main__":
    import json
    import sys

    # python -m tests.data_parallel.torch_ddp_suite OUT.json NAME...
    results = run(sys.argv[2:])
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)
