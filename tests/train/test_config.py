"""`TrainConfig`: every flag is honoured or refused, before any process starts.

Pure logic: no process group, no torch needed (the layout resolves against a
given world size). Each refusal has its own test and names the flag and the fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.models.config import GPTConfig
from cadence.pipeline.schedule import ScheduleValidationError
from cadence.train._errors import TrainConfigError
from cadence.train.build import topology_for
from cadence.train.config import Layout, TrainConfig


def test_defaults_resolve_to_data_parallel() -> None:
    assert TrainConfig().layout() == Layout(2, 1, 2, "DataParallel", bucket_cap_mb=0.25)
    fsdp = TrainConfig(fsdp=True, mixed_precision="bf16").layout()
    assert (fsdp.wrapper, fsdp.bucket_cap_mb) == ("fully_shard", None)


def test_pipeline_defaults_and_wrappers() -> None:
    two = TrainConfig(pp=2).layout()
    assert (two.schedule, two.microbatches, two.chunks, two.dp, two.wrapper) == (
        "1f1b",
        4,
        1,
        1,
        "none",
    )
    inter = TrainConfig(pp=2, schedule="Interleaved1F1B", nproc=4).layout()
    assert (inter.schedule, inter.chunks, inter.stages, inter.dp) == ("interleaved", 2, 4, 2)
    assert inter.wrapper == "DataParallel"  # dp > 1: each stage is wrapped
    assert TrainConfig(pp=2, nproc=4, fsdp=True).layout().wrapper == "fully_shard"
    # --fsdp is honoured with dp = 1 too (it is how bf16 compute is asked for)
    assert TrainConfig(pp=2, fsdp=True, mixed_precision="bf16").layout().wrapper == "fully_shard"


def test_world_size_comes_from_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = TrainConfig(pp=2, nproc=1)  # nproc is ignored under torchrun
    assert cfg.world_size == 4 and cfg.layout().dp == 2


REFUSED = [
    (dict(mixed_precision="bf16"), "--mixed-precision needs --fsdp"),
    (dict(mixed_precision="fp8"), "--mixed-precision must be none or bf16"),
    (dict(finalize="later"), "--finalize must be auto or manual"),
    (dict(batch_size=33, nproc=2), "--batch-size 33 must be divisible by the 2 ranks"),
    (dict(steps=0), "--steps must be an integer >= 1, got 0"),
    (dict(pp=0), "--pp must be an integer >= 1, got 0"),
    (dict(microbatches=-1), "--microbatches must be an integer >= 0 (0 picks 2 x pp), got -1"),
    (dict(bucket_cap_mb=0.0), "--bucket-cap-mb must be a finite number > 0 (MiB), got 0.0"),
    (dict(schedule="zbv"), "--schedule need --pp > 1"),
    (dict(microbatches=4, chunks=2), "--microbatches, --chunks need --pp > 1"),
    (dict(channel_mode="shared"), "--channel-mode need --pp > 1"),
    (dict(pp=2, channel_mode="ring"), "--channel-mode must be one of shared, per_direction"),
    (dict(fsdp=True, bucket_cap_mb=1.0), "--bucket-cap-mb sets DataParallel's buckets"),
    (dict(pp=2, bucket_cap_mb=1.0), "this run wraps with none"),
    (dict(pp=3), "--pp 3 must divide the world size 2"),
    (dict(pp=2, finalize="manual"), "--finalize manual needs --pp 1"),
    (dict(dp_replicate=2), "--dp-replicate (HSDP) needs --fsdp"),
    (dict(dp_replicate=0, fsdp=True), "--dp-replicate must be an integer >= 1, got 0"),
    (dict(dp_replicate=3, fsdp=True, nproc=4, pp=2), "--dp-replicate 3 must divide the 2"),
    (dict(pp=2, nproc=4, batch_size=12), "must be a multiple of dp (2) x microbatches (4) = 8"),
    (
        dict(pp=2, schedule="interleaved", chunks=4),
        "--layers 4 gives fewer blocks than the 8 pipeline stages",
    ),
    (dict(checkpoint_every=-1), "--checkpoint-every must be an integer >= 0 (0 saves none)"),
    (dict(keep=2), "--keep need --checkpoint-every K"),
    (dict(async_checkpoint=True), "--async-checkpoint need --checkpoint-every K"),
    (dict(checkpoint_every=5), "--checkpoint-every needs --run-dir"),
    (dict(resume=True), "--resume needs --run-dir"),
    (dict(overwrite=True), "--overwrite needs --run-dir"),
    (
        dict(overwrite=True, resume=True, run_dir="r"),
        "--resume continues the checkpoints in --run-dir and --overwrite deletes them",
    ),
    (dict(collective_timeout=0.0), "--collective-timeout must be a finite number > 0"),
    (dict(ac="partial"), "--ac must be one of none, full, selective, got 'partial'"),
    (dict(ac="full", compile=True), "--ac with --compile is not offered"),
    (dict(ac="full", pp=2, schedule="zb_h1"), "--ac with --schedule zb_h1: its split backward"),
    (dict(ac="selective", pp=2, schedule="zbv"), "--ac with --schedule zbv: its split backward"),
    (dict(ac="full", pp=2, schedule="dualpipev"), "--schedule dualpipev: its split backward"),
]


@pytest.mark.parametrize(("flags", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_refused(flags: dict, message: str) -> None:
    with pytest.raises(TrainConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**flags)


def test_schedule_rules_come_from_the_generator() -> None:
    with pytest.raises(ScheduleValidationError, match="unknown schedule 'zz'"):
        TrainConfig(pp=2, schedule="zz")
    with pytest.raises(ScheduleValidationError, match="dualpipev needs m >= 2p"):
        TrainConfig(
            pp=2, schedule="dualpipev", microbatches=3, batch_size=6, model=GPTConfig(n_layers=4)
        )


@pytest.mark.parametrize("fsdp", [False, True])
@pytest.mark.parametrize(
    "schedule", ["gpipe", "1f1b", "interleaved", "looped_bfs", "zb_h1", "zbv", "dualpipev"]
)
def test_every_schedule_takes_data_parallel_stages(schedule: str, fsdp: bool) -> None:
    layout = TrainConfig(pp=2, nproc=4, fsdp=fsdp, schedule=schedule, batch_size=16).layout()
    assert layout.dp == 2 and layout.wrapper == ("fully_shard" if fsdp else "DataParallel")


def test_hsdp_layout() -> None:
    layout = TrainConfig(nproc=4, pp=2, fsdp=True, dp_replicate=2, batch_size=16).layout()
    topo = topology_for(layout)
    assert (topo.pp, topo.dp_replicate, topo.dp_shard) == (2, 2, 1)


def test_errors_are_value_errors() -> None:
    assert issubclass(TrainConfigError, ValueError)


def test_a_written_config_never_replays_overwrite(tmp_path: Path) -> None:
    from cadence.train.config_file import config_to_toml, read_config_file

    cfg = TrainConfig(run_dir=str(tmp_path / "a"), overwrite=True)
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(cfg))
    # Replaying the file would otherwise delete the checkpoints this very run wrote.
    assert read_config_file(path)["overwrite"] is False


def test_a_written_config_never_replays_trust_checkpoint(tmp_path: Path) -> None:
    from cadence.train.config_file import config_to_toml, read_config_file

    cfg = TrainConfig(run_dir=str(tmp_path / "a"), resume=True, trust_checkpoint=True)
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(cfg))
    # The vouching was for the folder as it was; a replay must check signatures again.
    assert read_config_file(path)["trust_checkpoint"] is False
