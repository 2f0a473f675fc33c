"""`TrainConfig` values are type- and range-checked before anything starts.

Specification:
- each field's rule (kind, range) is derived from its type annotation, so a field
  cannot be added without one; every field but ``timeout`` has a ``cadence train``
  flag, and a refusal names that flag (``timeout``: its ``[train]`` key);
- ``TrainConfig(...)`` refuses a value of the wrong type (a string for a boolean, a
  boolean or a fractional number for an integer), NaN or infinity for any number, and
  a value out of range (negative learning rate, non-positive timeouts, a seed torch
  cannot take, a collective timeout past what the backends can wait), naming the
  flag and the value;
- a config file is checked key by key: the message names the file, the table and
  key, the value as written and its TOML type, and what is expected; an integer
  written as a float without a fractional part (``steps = 3.0``) is taken as 3;
- ``preflight`` refuses, before any rank starts, a ``--run-dir`` that is a file or
  lies under one, and a run whose memory (at least: fp32 parameters, gradients and
  AdamW moments, activations, the data, one interpreter per rank) exceeds this
  machine's.
"""

from __future__ import annotations

import math
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from cadence.cli import build_parser
from cadence.models.config import GPTConfig
from cadence.train._errors import TrainConfigError
from cadence.train.config import MODEL_RULES, RULES, TrainConfig, option_name
from cadence.train.config_file import read_config_file
from cadence.train.preflight import memory_needed, preflight

pytestmark = pytest.mark.torch_free


def test_every_field_has_a_rule_of_its_annotated_kind() -> None:
    hints = typing.get_type_hints(TrainConfig)
    # model and model_config are tables, checked by their own rules
    assert set(RULES) == {f.name for f in fields(TrainConfig)} - {"model", "model_config"}
    names = {bool: "bool", int: "int", float: "float", str: "str"}
    for name, rule in RULES.items():
        hint = hints[name]
        if typing.get_origin(hint) is typing.Literal:
            assert (rule.kind, set(rule.choices)) == ("str", set(typing.get_args(hint))), name
        elif type(None) in typing.get_args(hint):
            assert rule.optional and rule.kind == "float", name
        else:
            assert rule.kind == names[hint], name
    model_hints = typing.get_type_hints(GPTConfig)
    assert {n: r.kind for n, r in MODEL_RULES.items()} == {
        f.name: names[model_hints[f.name]] for f in fields(GPTConfig)
    }


def test_every_field_but_timeout_has_a_flag() -> None:
    train = build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    flags = {s for a in train._actions for s in a.option_strings}
    for name in RULES:
        assert (option_name(name) in flags) == (name != "timeout"), name
    assert "--model-config" in flags


REFUSED = [
    (dict(lr=math.nan), "--lr", "nan"),
    (dict(lr=math.inf), "--lr", "inf"),
    (dict(lr=-1e-3), "--lr", "-0.001"),
    (dict(timeout=math.nan), "[train] timeout", "nan"),
    (dict(timeout=0.0), "[train] timeout", "0.0"),
    (dict(timeout=-math.inf), "[train] timeout", "-inf"),
    (dict(collective_timeout=math.nan), "--collective-timeout", "nan"),
    (dict(collective_timeout=1e12), "--collective-timeout", "1000000000000.0"),
    (dict(bucket_cap_mb=math.nan), "--bucket-cap-mb", "nan"),
    (dict(bucket_cap_mb=math.inf), "--bucket-cap-mb", "inf"),
    (dict(steps=2.5), "--steps", "2.5"),
    (dict(steps=True), "--steps", "True"),
    (dict(steps="3"), "--steps", "'3'"),
    (dict(batch_size=8.0), "--batch-size", "8.0"),
    (dict(fsdp="false"), "--fsdp", "'false'"),
    (dict(fsdp=1), "--fsdp", "1"),
    (dict(seed=2**70), "--seed", str(2**70)),
    (dict(seed=-(2**70)), "--seed", str(-(2**70))),
    (dict(finalize=None), "--finalize", "None"),
    (dict(run_dir=None), "--run-dir", "None"),
    (dict(run_dir="a\x00b"), "--run-dir", "NUL"),
    (dict(run_dir="runs/\udcff"), "--run-dir", "\\udcff"),
    (dict(model=GPTConfig(d_model=64.0)), "--d-model", "64.0"),  # type: ignore[arg-type]
    (dict(model=GPTConfig(vocab_size=2**25)), "--vocab-size", str(2**25)),
    (dict(model="tiny"), "model", "'tiny'"),
]


@pytest.mark.parametrize(("values", "name", "shown"), REFUSED, ids=[str(v) for v, *_ in REFUSED])
def test_refused_values_name_the_flag_and_value(values: dict, name: str, shown: str) -> None:
    with pytest.raises(TrainConfigError) as info:
        TrainConfig(**values)
    message = str(info.value)
    assert name in message and shown in message, message
    assert "\n" not in message


def test_accepted_edges() -> None:
    TrainConfig(lr=0.0)  # trains nothing, but runs
    TrainConfig(lr=1)  # an int for a float field
    TrainConfig(seed=-5, collective_timeout=1e7, bucket_cap_mb=1e-3, timeout=0.5)


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_a_config_file_value_of_the_wrong_type_names_file_key_value_and_type(
    tmp_path: Path,
) -> None:
    path = _toml(tmp_path, '[train]\nfsdp = "false"\n')
    with pytest.raises(TrainConfigError) as info:
        read_config_file(path)
    message = str(info.value)
    assert str(path) in message and "[train] fsdp" in message
    assert '"false" (a string)' in message and "true or false" in message
    assert "without quotes" in message  # the fix for a quoted boolean
    path = _toml(tmp_path, "[train]\nsteps = 2.5\n")
    with pytest.raises(TrainConfigError, match=r"\[train\] steps must be an integer >= 1, got 2.5"):
        read_config_file(path)
    path = _toml(tmp_path, "[train.model]\nn_layers = true\n")
    with pytest.raises(
        TrainConfigError, match=r"\[train.model\] n_layers .* got true \(a boolean\)"
    ):
        read_config_file(path)


def test_a_whole_float_is_an_integer_and_an_int_is_a_float(tmp_path: Path) -> None:
    table = read_config_file(_toml(tmp_path, "[train]\nsteps = 3.0\nlr = 1\ntimeout = 60\n"))
    assert table["steps"] == 3 and type(table["steps"]) is int
    assert table["lr"] == 1.0 and type(table["lr"]) is float
    assert TrainConfig(**table).timeout == 60.0


def test_run_dir_that_is_a_file_is_refused_before_launch(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_text("")
    with pytest.raises(TrainConfigError, match="is a file, not a folder"):
        preflight(TrainConfig(run_dir=str(file)))
    with pytest.raises(TrainConfigError, match="lies under the file"):
        preflight(TrainConfig(run_dir=str(file / "a" / "b")))
    preflight(TrainConfig(run_dir=str(tmp_path)))  # an existing folder
    preflight(TrainConfig(run_dir=str(tmp_path / "new" / "deeper")))  # made at the end


def test_a_run_dir_name_the_system_refuses_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TrainConfigError, match="--run-dir"):
        preflight(TrainConfig(run_dir=str(tmp_path / ("x" * 5000))))


def test_memory_estimate() -> None:
    small = memory_needed(TrainConfig(), local_ranks=2, world=2)
    assert 0 < sum(small.values()) < 2**30  # the default run: well under 1 GiB
    huge = TrainConfig(model=GPTConfig(d_model=10**6))
    assert memory_needed(huge, local_ranks=2, world=2)["the model"] > 2**50
    with pytest.raises(TrainConfigError, match=r"--d-model 1000000.*use a smaller"):
        preflight(huge)
    preflight(TrainConfig())


# -- a node that rejoins under torchrun (see [Note: a node that rejoins under torchrun]) --

_TORCHRUN = {
    "TORCHELASTIC_MAX_RESTARTS": "3",
    "GROUP_WORLD_SIZE": "2",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({}, True),
        ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, False),  # the variable was set
        ({"TORCHELASTIC_MAX_RESTARTS": "0"}, False),  # no restart: nothing rejoins
        ({"GROUP_WORLD_SIZE": "1"}, False),  # one node: its agent is the store's owner
    ],
    ids=["shared_store", "store_not_shared", "no_restarts", "one_node"],
)
def test_a_torchrun_job_whose_nodes_cannot_rejoin_is_refused(
    change: dict[str, str], refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cadence.train.preflight import torchrun_rejoin_problem

    env = {**_TORCHRUN, **change}
    problem = torchrun_rejoin_problem(env)
    assert (problem is not None) == refused, problem
    if refused:
        assert problem is not None and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in problem
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        with pytest.raises(TrainConfigError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
            preflight(TrainConfig())
