"""``cadence train --config file.toml``: the same options, from a TOML file.

The file has a ``[train]`` table whose keys are `TrainConfig`'s field names
(``steps``, ``batch_size``, ``checkpoint_every``, ...) and an optional
``[train.model]`` table with `GPTConfig`'s (``d_model``, ``n_layers``, ...). A run of
another model names it with ``model_factory`` (``--model``) and gives its factory's
keyword arguments in a ``[train.model_config]`` table (``--model-config``); its
``[train.model]`` then holds only the data's ``vocab_size`` and ``seq_len`` (TOML cannot
give ``model`` both a string and a table). A flag given on the command line wins over
the file (``--model-config``'s keys over the table's). Each run writes the resolved values to
``<run_dir>/config.toml``, in this same format, so ``--config <run_dir>/config.toml``
repeats a run.

Every key is checked on its own against the rule of its field (`RULES`,
`MODEL_RULES` in `cadence.train.config`), and a refusal names the file, the table and
key, the value as written, its TOML type and what is expected: an error in a file
should be found without reading cadence's source.

[Note: config.toml reads back]
The file is UTF-8 (TOML's encoding, whatever the locale) and each string a TOML basic
string in which only the quote, the backslash and the control characters are
escaped; every other character is written as itself. JSON's escapes are not TOML's:
JSON writes a character outside the Basic Multilingual Plane (an emoji in a
``--run-dir``) as two ``\\uXXXX`` surrogate escapes, which TOML refuses, so the file
of such a run would not read back. Text TOML cannot hold at all (the lone
surrogates that stand for a path's undecodable bytes) is refused by `TrainConfig`
before the run, not found when the file is written at its end; so is a NUL, which
TOML can hold but no path can.

Torch-free; ``tomllib`` is in the standard library from Python 3.11 (``tomli`` is
used on 3.10 when installed).
"""

from __future__ import annotations

import datetime
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cadence.errors import CadenceValueError
from cadence.models.config import GPTConfig
from cadence.train._errors import TrainConfigError
from cadence.train._rules import ValueRule, text_problem
from cadence.train.config import MODEL_RULES, RULES, TrainConfig

__all__ = ["config_to_toml", "given_model_keys", "read_config_file"]


def _toml_loads(text: str, where: str) -> dict[str, Any]:
    try:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # Python 3.10
            import tomli as tomllib
    except ImportError:
        raise TrainConfigError(
            "--config needs Python 3.11 (tomllib) or the tomli package on 3.10"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TrainConfigError(f"{where}: not valid TOML: {exc}; fix that line") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The ``[train]`` table of ``path`` as `TrainConfig` keyword arguments (``model`` a
    `GPTConfig`). Unknown tables or keys, and values of the wrong type or range, are
    refused with a `TrainConfigError` naming the file, the key and the value."""
    path = Path(path)
    where = f"--config {path}"
    try:
        if not path.exists():
            raise TrainConfigError(f"{where}: no such file; give the path of a TOML file")
        if not path.is_file():
            raise TrainConfigError(f"{where}: not a file; give the path of a TOML file")
        data = path.read_bytes()
    except OSError as exc:
        raise TrainConfigError(f"{where}: cannot be read ({exc.strerror})") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TrainConfigError(
            f"{where}: not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x}); "
            "TOML files are UTF-8: save it as UTF-8"
        ) from None
    raw = _toml_loads(text, where)
    extra = sorted(set(raw) - {"train"})
    if extra or not isinstance(raw.get("train"), dict):
        raise TrainConfigError(
            f"{where}: expected one [train] table, found {sorted(raw) or 'none'}"
        )
    table = dict(raw["train"])
    known = {*RULES, "model", "model_config"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise TrainConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)} in [train]; the keys are "
            f"the flags' names with underscores: {', '.join(sorted(RULES))}"
        )
    values = {
        key: _checked(where, "train", key, value, RULES[key])
        for key, value in table.items()
        if key not in ("model", "model_config")
    }
    problem = text_problem(values.get("run_dir", ""))
    if problem:
        raise TrainConfigError(f"{where}: [train] run_dir {_shown(values['run_dir'])} {problem}")
    if "model" in table:
        values["model"] = _read_model(where, table["model"])
    if "model_config" in table:
        kwargs = table["model_config"]
        if not isinstance(kwargs, dict):
            raise TrainConfigError(
                f"{where}: [train] model_config must be a table ([train.model_config]) of "
                f"the model factory's keyword arguments, got {_shown(kwargs)} "
                f"({_toml_type(kwargs)})"
            )
        values["model_config"] = kwargs
    return values


def given_model_keys(path: str | Path) -> frozenset[str]:
    """The keys ``path``'s ``[train.model]`` table names (the file already passed
    `read_config_file`): a value the file leaves out may be set another way, e.g.
    ``vocab_size`` by ``--data``."""
    raw = _toml_loads(Path(path).read_bytes().decode("utf-8"), f"--config {path}")
    model = raw.get("train", {}).get("model", {})
    return frozenset(model) if isinstance(model, dict) else frozenset()


def _read_model(where: str, model: object) -> GPTConfig:
    if not isinstance(model, dict):
        raise TrainConfigError(
            f"{where}: [train] model must be a table ([train.model]) with the keys "
            f"{', '.join(MODEL_RULES)}, got {_shown(model)} ({_toml_type(model)})"
        )
    unknown = sorted(set(model) - set(MODEL_RULES))
    if unknown:
        raise TrainConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)} in [train.model]; it takes "
            f"{', '.join(MODEL_RULES)}"
        )
    values = {k: _checked(where, "train.model", k, v, MODEL_RULES[k]) for k, v in model.items()}
    base = GPTConfig()
    d, heads = values.get("d_model", base.d_model), values.get("n_heads", base.n_heads)
    if d % heads:
        raise TrainConfigError(
            f"{where}: [train.model] d_model {d} must be a multiple of n_heads {heads}: "
            f"use d_model = {d + heads - d % heads}, or an n_heads that divides {d}"
        )
    try:
        return GPTConfig(**values)
    except CadenceValueError as exc:  # a rule of GPTConfig's that the keys' miss
        raise TrainConfigError(f"{where}: [train.model] {exc}") from exc


def _checked(where: str, table: str, key: str, value: Any, rule: ValueRule) -> Any:
    """``value`` as the field's kind (a whole float as an int, an int as a float), or
    a `TrainConfigError` naming the key, the value, its TOML type and the rule."""
    if rule.kind == "int" and isinstance(value, float) and value.is_integer():
        value = int(value)
    elif rule.kind == "float" and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            pass  # refused below, as not finite
    if rule.accepts(value):
        return value
    hint = ""
    if isinstance(value, str) and rule.kind != "str":
        try:
            unquoted = _toml_loads(f"v = {value}", where)["v"]
        except TrainConfigError:
            unquoted = None
        if unquoted is not None and rule.accepts(unquoted):
            hint = f"; write {key} = {value} without quotes"
    raise TrainConfigError(
        f"{where}: [{table}] {key} must be {rule.expected()}, got {_shown(value)} "
        f"({_toml_type(value)}){hint}"
    )


def _toml_type(v: object) -> str:
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a float"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "a table"
    return "a date or time"


def _shown(v: object) -> str:
    """``v`` as TOML spells it, for an error message (any value TOML reads)."""
    if isinstance(v, list):
        return "[" + ", ".join(_shown(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_shown(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (datetime.date, datetime.time)):
        return v.isoformat()
    return _value(v)


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
# The short escapes TOML defines; other control characters are written \uXXXX.
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string. See [Note: config.toml reads back]."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        elif 0xD800 <= code <= 0xDFFF:
            raise CadenceValueError(
                f"{text!r} holds a lone surrogate ({ch!r}), which TOML text cannot hold"
            )
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else _toml_string(k)


def _value(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)  # a float's shortest repr reads back exactly; nan and inf are TOML's
    return _toml_string(str(v))


def config_to_toml(cfg: TrainConfig) -> str:
    """``cfg`` as a file `read_config_file` reads back to the same config (write it as
    UTF-8: see [Note: config.toml reads back])."""
    values = asdict(cfg)
    # A replay of this file must not delete checkpoints unless asked again on its own
    # command line: by then the folder holds this run's checkpoints, not the old ones.
    values["overwrite"] = False
    # Nor vouch for a checkpoint unasked: --trust-checkpoint was said of the folder as it
    # was then, and a replay would skip the signature of whatever is there later.
    values["trust_checkpoint"] = False
    model = values.pop("model")
    kwargs = values.pop("model_config")
    if cfg.model_factory:  # the data's shape only: see the module's docstring
        model = {k: model[k] for k in ("vocab_size", "seq_len")}
    else:
        del values["model_factory"]
    lines = ["# The resolved options of this run: cadence train --config <this file>", "[train]"]
    lines += [f"{k} = {_value(v)}" for k, v in values.items() if v is not None]
    lines += ["", "[train.model]"]
    lines += [f"{k} = {_value(v)}" for k, v in model.items()]
    if kwargs:
        lines += ["", "[train.model_config]"]
        lines += [f"{_key(k)} = {_value(v)}" for k, v in kwargs.items()]
    return "\n".join(lines) + "\n"
