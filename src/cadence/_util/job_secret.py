"""The secret one job's ranks share: ``CADENCE_JOB_SECRET``, hex.

[Note: the job secret]
Bytes one rank sends another that the receiver will unpickle (a precompiled artifact)
must be signed with a key only the job's ranks hold; a key written in the source signs
nothing, since anyone can read it. The secret comes from the environment variable
``CADENCE_JOB_SECRET`` (hex, at least 16 bytes):

* `cadence.launch` draws a new one per launch (``secrets.token_hex(32)``) and puts it in
  every rank's environment, which only the same user (and root) can read, so it never
  travels over the network;
* under another launcher (torchrun, a batch system) the user may export one to every
  rank the same way (``export CADENCE_JOB_SECRET=$(python -c "import secrets;
  print(secrets.token_hex(32))")`` in the job script);
* without it, the code that needs one agrees on one over the process group itself
  (`cadence.precompile` does, see [Note: precompile transport key]): that secret is
  only as private as the group's traffic, which is what torch.distributed already
  trusts.

This module reads and makes the secret; it imports nothing but cadence's errors, so
the launcher stays cheap to import.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

from cadence.errors import CadenceValueError

__all__ = ["ENV_VAR", "FIX", "SECRET_BYTES", "from_env", "new"]

ENV_VAR = "CADENCE_JOB_SECRET"
SECRET_BYTES = 32
_MIN_BYTES = 16
FIX = (
    f"set {ENV_VAR} to the same secrets.token_hex(32) on every rank of the job, "
    "or unset it everywhere"
)


def new() -> str:
    """A fresh secret, as hex (what `cadence.launch` gives each launch)."""
    return secrets.token_hex(SECRET_BYTES)


def from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The job's secret from ``CADENCE_JOB_SECRET``; None when it is unset or empty.

    Raises `CadenceValueError` (naming the fix, never the value) when it is set but is
    not hex or is shorter than 16 bytes.
    """
    value = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not value:
        return None
    try:
        secret = bytes.fromhex(value)
    except ValueError:
        raise CadenceValueError(f"{ENV_VAR} is not hex; {FIX}") from None
    if len(secret) < _MIN_BYTES:
        raise CadenceValueError(
            f"{ENV_VAR} holds {len(secret)} bytes, fewer than {_MIN_BYTES}; {FIX}"
        )
    return secret
