"""What each ``cadence train`` value may be: a kind (from the field's annotation) and a
range, checked alike for a flag, a config file's key and a direct ``TrainConfig(...)``.

Standard library only: `cadence.train.config` derives its rules from here, and the
config-file reader checks each key with them before any `TrainConfig` exists.

[Note: a value is refused where it is given, not where it breaks]
A value that passes here is one the ranks can use. Python's own types are too loose
to say so: ``True`` is an ``int``, a non-empty string is truthy (``fsdp = "false"``
would shard), and NaN passes every comparison a range check makes (``nan <= 0`` is
false), so NaN and infinity are refused for every number, booleans for every
integer, and strings for everything but text. A config file's whole floats
(``steps = 3.0``) become integers in the reader, which knows the value came from
TOML; a caller of ``TrainConfig(...)`` passes the int.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, fields
from typing import Any, Literal

from cadence.errors import CadenceValueError

__all__ = ["ValueRule", "derive_rules", "text_problem"]

Kind = Literal["bool", "int", "float", "str"]
_KINDS: dict[Any, Kind] = {bool: "bool", int: "int", float: "float", str: "str"}


@dataclass(frozen=True)
class ValueRule:
    """The kind and range one value must have; ``expected()`` says it in words."""

    kind: Kind
    low: float | None = None
    """Smallest accepted value (inclusive unless ``above``)."""
    above: bool = False
    """``low`` itself is refused: the value must be greater."""
    high: float | None = None
    """Largest accepted value (inclusive)."""
    choices: tuple[str, ...] = ()
    """For ``str``: the accepted values; "" among them stands for "unset"."""
    optional: bool = False
    """None is accepted (the field's "unset")."""
    note: str = ""
    """What the value means, shown after the rule (e.g. "0 keeps all")."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS.values():
            raise CadenceValueError(f"ValueRule.kind must be one of {sorted(_KINDS.values())}")
        bounded = self.low is not None or self.high is not None
        if bounded and self.kind not in ("int", "float"):
            raise CadenceValueError(f"ValueRule: a {self.kind} takes no low/high bound")
        if self.choices and self.kind != "str":
            raise CadenceValueError(f"ValueRule: a {self.kind} takes no choices")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise CadenceValueError(f"ValueRule: low {self.low} is above high {self.high}")

    def accepts(self, value: object) -> bool:
        if value is None:
            return self.optional
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str) and (not self.choices or value in self.choices)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "int" and not isinstance(value, int):
            return False
        if self.kind == "float":
            try:
                if not math.isfinite(value):
                    return False
            except OverflowError:  # an int past the largest float
                return False
        if self.low is not None and (value <= self.low if self.above else value < self.low):
            return False
        return self.high is None or value <= self.high

    def expected(self) -> str:
        """The rule in words: ``an integer >= 1``, ``true or false``, ``auto or manual``."""
        if self.kind == "bool":
            return "true or false"
        if self.choices:
            named = [c for c in self.choices if c]
            words = " or ".join(named) if len(named) == 2 else "one of " + ", ".join(named)
            text = words + (' or "" (the default)' if "" in self.choices else "")
        elif self.kind == "str":
            text = "a string"
        else:
            text = "an integer" if self.kind == "int" else "a finite number"
            if self.low is not None and self.high is not None and not self.above:
                text += f" from {_number(self.low)} to {_number(self.high)}"
            else:
                bounds = []
                if self.low is not None:
                    bounds.append(f"{'>' if self.above else '>='} {_number(self.low)}")
                if self.high is not None:
                    bounds.append(f"<= {_number(self.high)}")
                if bounds:
                    text += " " + " and ".join(bounds)
        return text + (f" ({self.note})" if self.note else "")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else repr(x)


def derive_rules(cls: type, **bounds: dict[str, Any]) -> dict[str, ValueRule]:
    """A `ValueRule` per field of the dataclass ``cls`` whose annotation is a plain
    kind (bool, int, float, str), a ``Literal`` of strings (its choices) or either
    ``| None``; ``bounds[name]`` adds the range and note. A field of another type
    (a nested dataclass) gets no rule: its own rules check it."""
    hints = typing.get_type_hints(cls)
    rules = {}
    for f in fields(cls):
        hint, optional, choices = hints[f.name], False, ()
        args = typing.get_args(hint)
        if type(None) in args:
            optional = True
            (hint,) = [a for a in args if a is not type(None)]
        if typing.get_origin(hint) is Literal:
            hint, choices = str, typing.get_args(hint)
        if hint not in _KINDS:
            continue
        extra = dict(bounds.pop(f.name, {}))
        rules[f.name] = ValueRule(
            _KINDS[hint], optional=optional, choices=extra.pop("choices", choices), **extra
        )
    if bounds:
        raise CadenceValueError(f"bounds name no field of {cls.__name__}: {sorted(bounds)}")
    return rules


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be a path stored in ``config.toml``, or None.

    No path holds a NUL, and TOML strings are Unicode text, in which a lone surrogate
    (how Python spells a POSIX path's bytes that are not UTF-8) has no spelling."""
    if "\x00" in text:
        return "holds a NUL character, which no path can"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return (
            "is not valid Unicode (bytes that are not UTF-8), so config.toml cannot "
            "record it; rename the folder"
        )
    return None
