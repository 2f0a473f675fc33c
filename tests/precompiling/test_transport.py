"""Artifacts sent between ranks are signed with a secret of the job, not a constant.

Specification (see [Note: the job secret] and [Note: precompile transport key]):
- `cadence.launch` gives every rank of one launch the same ``CADENCE_JOB_SECRET``
  (64 hex digits, from ``secrets.token_hex(32)``), and two launches get different ones;
  the launch's work folder, which holds what the ranks unpickle, is private (0700);
- an artifact signed with the constant older cadence used is refused by the receiving
  rank before anything is unpickled, and that rank compiles on its own;
- a receiving rank whose secret differs from the sender's refuses the artifact the same
  way;
- a secret set on some ranks only, or one that is not hex, is refused on every rank of
  the group (`PrecompileUsageError` naming the fix), so no rank hangs;
- without ``CADENCE_JOB_SECRET`` (plain torchrun), rank ``src`` draws 32 random bytes
  and sends them to the group before the first artifact, once per process group: both
  ranks hold the same secret, and the next call sends none;
- with the secret in the environment, nothing but the artifact travels;
- a cache directory that one rank refuses (`UntrustedPathError`) is raised on every
  rank, after one small collective, before anything is compiled: no rank hangs;
- the secret's value is checked where it is read: hex, at least 16 bytes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from cadence.testing import run_distributed
from tests.precompiling import _transport_bodies
from tests.precompiling._transport_bodies import launch_facts, transport_body

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

HEX64 = re.compile(r"[0-9a-f]{64}")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    base = tmp_path_factory.mktemp("transport")
    os.chmod(base, 0o700)
    untrusted = base / "untrusted"
    untrusted.mkdir()
    os.chmod(untrusted, 0o777)
    return run_distributed(
        transport_body, str(base / "good"), str(untrusted), world_size=2, timeout=400
    )


def test_one_launch_shares_one_secret_and_two_launches_differ(
    ranks: list[dict[str, Any]],
) -> None:
    first = [r["secret"] for r in ranks]
    assert first[0] == first[1] and HEX64.fullmatch(first[0] or ""), first
    second = [r["secret"] for r in run_distributed(launch_facts, world_size=2, timeout=120)]
    assert second[0] == second[1] and HEX64.fullmatch(second[0] or ""), second
    assert first[0] != second[0]


def test_the_launch_work_folder_is_private(ranks: list[dict[str, Any]]) -> None:
    assert [r["work_mode"] for r in ranks] == [0o700, 0o700]


def test_an_artifact_signed_with_the_old_constant_is_refused(
    ranks: list[dict[str, Any]],
) -> None:
    sender, receiver = (r["old_key"] for r in ranks)
    assert sender["source"] == "compiled" and sender["error"] is None
    assert receiver["flag"] == [], "the forged payload was unpickled"
    assert receiver["source"] == "compiled" and receiver["compiles"] == 1
    assert receiver["value"] == [2.0, 2.0, 2.0]
    (refused,) = receiver["refused"]
    assert "the artifact rank 0 sent was refused (corrupt: the signature does not verify" in (
        refused
    )
    assert "CADENCE_JOB_SECRET" in refused  # names what to check


def test_a_receiver_with_another_secret_refuses(ranks: list[dict[str, Any]]) -> None:
    sender, receiver = (r["other_secret"] for r in ranks)
    assert sender["source"] == "compiled"
    assert receiver["source"] == "compiled" and receiver["compiles"] == 1
    (refused,) = receiver["refused"]
    assert "the signature does not verify" in refused


def test_a_secret_on_some_ranks_only_is_refused_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        case = r["one_rank_secret"]
        assert case["compiles"] == 0 and case["source"] is None
        assert case["error"].startswith("PrecompileUsageError: ")
        assert "CADENCE_JOB_SECRET is set on group ranks [0] but not on [1]" in case["error"]
        assert "on every rank of the job, or unset it everywhere" in case["error"]


def test_a_secret_that_is_not_hex_is_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        case = r["bad_secret"]
        assert case["compiles"] == 0 and case["source"] is None
        assert case["error"].startswith("PrecompileUsageError: ")
        assert "CADENCE_JOB_SECRET is not hex" in case["error"]
        assert "secrets.token_hex(32)" in case["error"]


def test_without_a_secret_rank_src_sends_one_once_per_group(
    ranks: list[dict[str, Any]],
) -> None:
    secrets_held = [r["fallback_secret"] for r in ranks]
    assert secrets_held[0] == secrets_held[1] and HEX64.fullmatch(secrets_held[0] or "")
    assert secrets_held[0] != ranks[0]["secret"]  # drawn, not the launch's
    for r in ranks:
        first, second = r["fallback_first"], r["fallback_second"]
        assert (first["error"], second["error"]) == (None, None)
        assert first["broadcasts"] == 3  # the secret, the status, the artifact
        assert second["broadcasts"] == 2  # the group's secret is known: no exchange
    assert [r["fallback_first"]["source"] for r in ranks] == ["compiled", "received"]
    assert [r["fallback_second"]["source"] for r in ranks] == ["compiled", "received"]


def test_with_the_secret_in_the_environment_only_the_artifact_travels(
    ranks: list[dict[str, Any]],
) -> None:
    assert [r["env"]["source"] for r in ranks] == ["compiled", "received"]
    assert [r["env"]["broadcasts"] for r in ranks] == [2, 2]


def test_an_untrusted_cache_on_one_rank_is_raised_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    mine, theirs = ranks[1]["untrusted_one_rank"], ranks[0]["untrusted_one_rank"]
    assert mine["error"].startswith("UntrustedPathError: ")
    assert "writable by others (mode 777); run `chmod go-w" in mine["error"]
    assert theirs["error"].startswith("UntrustedPathError: group rank 1 refused its cache")
    assert "chmod go-w" in theirs["error"]
    assert mine["compiles"] == theirs["compiles"] == 0
    assert mine["flag"] == theirs["flag"] == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("not hex", "CADENCE_JOB_SECRET is not hex"),
        ("abcd", "CADENCE_JOB_SECRET holds 2 bytes"),
    ],
)
def test_a_malformed_secret_is_refused_where_it_is_read(value: str, message: str) -> None:
    from cadence._util import job_secret as _job_secret

    with pytest.raises(ValueError, match=f"{message}.*secrets.token_hex\\(32\\)"):
        _job_secret.from_env({_job_secret.ENV_VAR: value})


def test_a_secret_is_read_from_the_environment_and_new_ones_differ() -> None:
    from cadence._util import job_secret as _job_secret

    fresh = _job_secret.new()
    assert HEX64.fullmatch(fresh) and fresh != _job_secret.new()
    assert _job_secret.from_env({_job_secret.ENV_VAR: fresh}) == bytes.fromhex(fresh)
    assert _job_secret.from_env({}) is None
    assert _job_secret.ENV_VAR == _transport_bodies.ENV


def test_the_old_constant_is_gone_from_the_source() -> None:
    source = Path(_transport_bodies.__file__).parents[2] / "src" / "cadence" / "precompiling"
    paths = sorted(source.glob("*.py"))
    assert len(paths) > 3 and source / "__init__.py" in paths, f"no package at {source}"
    for path in paths:
        text = path.read_bytes()  # the constant, under the package's old and new name
        assert b"cadence.precompile.transport" not in text, path
        assert b"cadence.precompiling.transport" not in text, path
