"""Every world-2 fully_shard rank body in one launch (process start-up dominates).

The sections are independent (each builds and seeds its own models); the
checkpoint saved last is loaded by the world-4 run.
"""

from __future__ import annotations

from typing import Any

from tests.fsdp.bodies_parity import parity_body
from tests.fsdp.bodies_semantics import semantics_body
from tests.fsdp.bodies_world4 import dcp_save_body

__all__ = ["world2"]


def world2(dcp_path: str) -> dict[str, Any]:
    return {
        "parity": parity_body(),
        "semantics": semantics_body(),
        "dcp_saved": dcp_save_body(dcp_path),
    }
