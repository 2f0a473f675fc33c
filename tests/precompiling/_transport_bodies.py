"""Rank bodies for the artifact broadcast's authentication (importable by ranks).

Each case runs on both ranks in the same order and records what happened instead of
raising, so that one case's outcome never desynchronizes the collectives of the next.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import stat
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from cadence.comm import EventLog
from cadence.precompiling import (
    CacheRefusedWarning,
    _api,
    _artifact,
    _share,
    _torch_aot,
    precompile,
    stats,
)
from tests.precompiling import _bodies
from tests.precompiling._bodies import BACKEND, Boom

ENV = "CADENCE_JOB_SECRET"
# The constant every cadence release before the per-job secret signed broadcasts with:
# anyone who reads the source can sign an artifact with it.
OLD_TRANSPORT_KEY = b"cadence.precompile.transport"
OTHER_SECRET = "ab" * 32


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


def triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3.0


def launch_facts() -> dict[str, Any]:
    """The secret this rank was started with, and the mode of the launch's work folder."""
    work = sys.argv[1]  # ``python -m cadence._worker WORK RANK``
    return {"secret": os.environ.get(ENV), "work_mode": stat.S_IMODE(os.stat(work).st_mode)}


@contextlib.contextmanager
def _secret(value: str | None) -> Iterator[None]:
    old = os.environ.get(ENV)
    if value is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def _call(fn: Callable[..., Any] = double, **kwargs: Any) -> dict[str, Any]:
    """One precompile call: where it came from, its warnings, its error, and its cost."""
    _bodies.FLAG.clear()
    log = EventLog()
    before = stats()["compiles"]
    out: dict[str, Any] = {"source": None, "error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CacheRefusedWarning)
        try:
            compiled = precompile(fn, (torch.ones(3),), backend=BACKEND, event_log=log, **kwargs)
            out["source"] = compiled.source
            out["value"] = compiled(torch.ones(3)).tolist()
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
    out["refused"] = [str(w.message) for w in caught if w.category is CacheRefusedWarning]
    out["flag"] = list(_bodies.FLAG)
    out["compiles"] = stats()["compiles"] - before
    out["broadcasts"] = log.count("broadcast")
    return out


def _sign_with_the_old_constant(
    header: dict[str, Any], sections: dict[str, bytes], key: bytes
) -> bytes:
    """What a forger sends: a payload that sets FLAG when unpickled, signed with the
    constant that was in the source."""
    payload = _torch_aot.payload_header() + pickle.dumps(Boom())
    return _artifact.encode(header, {"artifact": payload}, OLD_TRANSPORT_KEY)


def _group_secret() -> str | None:
    known = getattr(_share, "_GROUP_SECRETS", None)
    if known is None:
        return None
    secret = known.get(dist.group.WORLD)
    return None if secret is None else secret.hex()


def transport_body(good_cache: str, untrusted_cache: str) -> dict[str, Any]:
    rank = dist.get_rank()
    _share.HEARTBEAT_S = 1000.0  # no heartbeat: the broadcast counts are exact
    out: dict[str, Any] = {"rank": rank, **launch_facts()}

    out["env"] = _call()

    # A forged artifact signed with the old constant transport key.
    real_encode = _api.encode
    if rank == 0:
        _api.encode = _sign_with_the_old_constant  # type: ignore[assignment]
    try:
        out["old_key"] = _call()
    finally:
        _api.encode = real_encode  # type: ignore[assignment]

    with _secret(OTHER_SECRET if rank == 1 else os.environ.get(ENV)):
        out["other_secret"] = _call()
    with _secret(None if rank == 1 else os.environ.get(ENV)):
        out["one_rank_secret"] = _call()
    with _secret("not hex"):
        out["bad_secret"] = _call()
    with _secret(None):  # as under plain torchrun
        out["fallback_first"] = _call()
        out["fallback_secret"] = _group_secret()
        out["fallback_second"] = _call(triple)

    out["untrusted_one_rank"] = _call(cache_dir=untrusted_cache if rank == 1 else good_cache)
    return out
