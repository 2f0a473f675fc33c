"""``cadence train --config file.toml``: the same options, from a TOML file.

The file has a ``[train]`` table whose keys are `TrainConfig`'s field names
(``steps``, ``batch_size``, ``checkpoint_every``, ...) and an optional
``[train.model]`` table with `GPTConfig`'s (``d_model``, ``n_layers``, ...). A flag
given on the command line wins over the file. Each run writes the resolved values to
``<run_dir>/config.toml``, in this same format, so ``--config <run_dir>/config.toml``
repeats a run.

Torch-free; ``tomllib`` is in the standard library from Python 3.11 (``tomli`` is
used on 3.10 when installed).
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from cadence.models.config import GPTConfig
from cadence.train.config import TrainConfig, TrainConfigError

__all__ = ["config_to_toml", "read_config_file"]


def _toml_loads(text: str) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise TrainConfigError(
                "--config needs Python 3.11 (tomllib) or the tomli package on 3.10"
            ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TrainConfigError(f"--config: not valid TOML: {exc}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The ``[train]`` table of ``path`` as `TrainConfig` keyword arguments (``model`` a
    `GPTConfig`). Unknown tables or keys are refused, naming them."""
    path = Path(path)
    if not path.is_file():
        raise TrainConfigError(f"--config {path}: no such file")
    raw = _toml_loads(path.read_text())
    extra = sorted(set(raw) - {"train"})
    if extra or "train" not in raw:
        raise TrainConfigError(
            f"--config {path}: expected one [train] table, found {sorted(raw) or 'none'}"
        )
    table = dict(raw["train"])
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise TrainConfigError(
            f"--config {path}: unknown key(s) {', '.join(unknown)} in [train]; the keys are "
            f"the flags' names with underscores: {', '.join(sorted(known - {'model'}))}"
        )
    if "model" in table:
        model = table["model"]
        model_keys = {f.name for f in fields(GPTConfig)}
        if not isinstance(model, dict) or set(model) - model_keys:
            raise TrainConfigError(
                f"--config {path}: [train.model] takes {', '.join(sorted(model_keys))}"
            )
        table["model"] = GPTConfig(**model)
    return table


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's


def config_to_toml(cfg: TrainConfig) -> str:
    """``cfg`` as a file `read_config_file` reads back to the same config."""
    values = asdict(cfg)
    # A replay of this file must not delete checkpoints unless asked again on its own
    # command line: by then the folder holds this run's checkpoints, not the old ones.
    values["overwrite"] = False
    model = values.pop("model")
    lines = ["# The resolved options of this run: cadence train --config <this file>", "[train]"]
    lines += [f"{k} = {_value(v)}" for k, v in values.items() if v is not None]
    lines += ["", "[train.model]"]
    lines += [f"{k} = {_value(v)}" for k, v in model.items()]
    return "\n".join(lines) + "\n"
