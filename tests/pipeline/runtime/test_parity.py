"""Parity for every schedule: cadence vs one process, and cadence vs torch pipelining.

Specification: for every schedule cadence generates (and, at world 2, torch's own
lowered IR of three of them, parsed into cadence's IR), one step gives per-microbatch
losses and gradients equal to a single process on the full batch (within 1e-6),
and equal to ``torch.distributed.pipelining`` running the same schedule on the
same model; every P2P op runs on the channel its plan names; the V turn is a LOCAL
hand-off and the looped wrap-around a channel of its own.
"""

from __future__ import annotations

import ast

import pytest

from cadence.testing import run_distributed
from tests.pipeline.runtime.bodies_parity import TOL, body_parity, configs


def _check(results: list[dict[str, dict]], p: int) -> dict[str, list[dict]]:
    by_config: dict[str, list[dict]] = {}
    for rank_rows in results:
        for label, row in rank_rows.items():
            by_config.setdefault(label, []).append(row)
    assert len(by_config) == len(configs(p))
    problems = []
    for config, rows in by_config.items():
        n_loss_ranks = sum(r["has_losses"] for r in rows)
        if n_loss_ranks != 1:
            problems.append(f"{config}: losses on {n_loss_ranks} ranks")
        for r in rows:
            if not r["op_channel_matches"]:
                problems.append(f"{config}: a P2P op ran on a channel other than its plan's")
            if r["recv_timing"]["late"]:
                problems.append(f"{config}: a receive was posted after its place in the list")
            for key in ("grad_vs_ref", "loss_vs_ref", "grad_vs_torch", "loss_vs_torch"):
                if key in r and not r[key] <= TOL:
                    problems.append(f"{config}: {key} = {r[key]:.3e}")
    assert not problems, "\n".join(problems)
    for config, rows in by_config.items():
        name, v, m, _source = ast.literal_eval(config.partition("=")[2])
        # receive lookahead (default 1 on per-edge channels) posts some receives early
        if m >= 2:
            assert any(r["recv_timing"]["early"] for r in rows), (config, rows)
        # V schedules: the turn (stage p-1 -> p) is on the last rank and issues no P2P:
        # exactly m LOCAL hand-offs each way there, none elsewhere.
        if name in ("zbv", "dualpipev"):
            counts = [(r["local_fwd"], r["local_bwd"]) for r in rows]
            assert sorted(counts) == [(0, 0)] * (p - 1) + [(m, m)], (config, counts)
        # looped placements: the wrap-around (p-1 -> 0) and its gradient (0 -> p-1)
        if v == 2 and name not in ("zbv", "dualpipev"):
            seen = set().union(*(r["channels"] for r in rows))
            assert {f"pp{p - 1}->0", f"pp0->{p - 1}"} <= seen, (config, seen)
    return by_config


def test_parity_every_schedule_world2():
    results = run_distributed(body_parity, configs(2), world_size=2, timeout=150)
    by_config = _check(results, 2)
    # torch must have run the common schedules, so the comparison is not vacuous
    for name in ("gpipe", "1f1b", "interleaved", "zbv"):
        assert any(
            r.get("torch") == "ran"
            for c, rows in by_config.items()
            if f"('{name}'," in c
            for r in rows
        ), name


@pytest.mark.slow
@pytest.mark.other_lane  # [Note: costly launcher tests run on the other lane only]
def test_parity_every_schedule_world4():
    results = run_distributed(body_parity, configs(4), world_size=4, timeout=240)
    _check(results, 4)
