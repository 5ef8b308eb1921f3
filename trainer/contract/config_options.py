"""A config option's metadata: its flag, help and accepted values, declared once with the field.

`opt` declares a field of a config section (trainer.contract.config_schema) with its command-line flag, help
text and what values it accepts: `choices` for enumerated options, a `Range` for every number (declaring a
numeric option without one is an error at import), `words` for the few spelled-out values a number may also
take (`micro_batch = "auto"`), `check` for a format, and `path` naming the input check of
`trainer.contract.inputs` a path option gets. `coerce` converts and checks a value where it enters (a flag, a
TOML file), with an error naming the flag or the file and key; `type_problem` and `value_problem` check a
value already set (`TrainConfig.validate`) from the same metadata. `number_arg` gives gptop's own numeric flags
the same conversion and range checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from .common import ConfigError, show


@dataclass(frozen=True)
class Range:
    """The accepted values of a numeric option: finite, from `low` to `high` (inclusive unless open)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def problem(self, value: float) -> str | None:
        """Why `value` is refused, or None."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"{value} is not a finite number; accepted: {self}"
        if isinstance(value, int) and value.bit_length() > 200:
            return f"{show(value)} is out of range; accepted: {self}"
        low, high = self.low, self.high
        if (low is not None and (value < low or (self.low_open and value == low))) or (
            high is not None and (value > high or (self.high_open and value == high))
        ):
            return f"{value} is out of range; accepted: {self}"
        return None

    def __str__(self) -> str:
        text = "x"
        if self.low is not None:
            text = f"{_num(self.low)} {'<' if self.low_open else '<='} {text}"
        if self.high is not None:
            text = f"{text} {'<' if self.high_open else '<='} {_num(self.high)}"
        return text


def _num(v: float) -> str:
    return str(v) if isinstance(v, int) or not float(v).is_integer() or abs(v) < 1e6 else f"{v:g}"


def opt(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: tuple | None = None,
    metavar: str | None = None,
    kind: type | None = None,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    words: tuple[str, ...] = (),
    check: Callable[[Any], str | None] | None = None,
    path: str | None = None,
    hidden: bool = False,
) -> Any:
    """A config field with its command-line flag, help and accepted values in one place.

    A number needs a range (`low`/`high`, inclusive unless `*_open`): a new numeric option cannot be
    declared without saying which values make sense. `kind` is the value type where the annotation
    is a union (`micro_batch`: int, or one of `words`); `check(value)` returns why a value is refused;
    `path` names the check of `trainer.contract.inputs` for a path option; `hidden` leaves it out of --help."""
    kind = kind or (type(default) if isinstance(default, (bool, int, float)) else None)
    rng = None
    if kind in (int, float):
        if low is None and high is None:
            raise TypeError(f"numeric option (default {default!r}) declared without a range: give low=/high=")
        rng = Range(low, high, low_open, high_open)
    meta = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "metavar": metavar,
        "kind": kind,
        "range": rng,
        "words": tuple(words),
        "check": check,
        "path": path,
        "hidden": hidden,
    }
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def range_of(f: dataclasses.Field) -> Range | None:
    """The accepted range of a numeric field (None for the others)."""
    return f.metadata.get("range")


_TYPE_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def kind_of(f: dataclasses.Field) -> type:
    """The value type of a field: bool, int, float or str."""
    if f.metadata.get("kind"):
        return f.metadata["kind"]
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if t.startswith(name):
            return kind
    return str


def optional(f: dataclasses.Field) -> bool:
    return "None" in (f.type if isinstance(f.type, str) else str(f.type))


def _expected(f: dataclasses.Field) -> str:
    words = " or ".join(repr(w) for w in f.metadata.get("words", ()))
    return f"{_TYPE_NAMES[kind_of(f)]}" + (f" or {words}" if words else "")


def type_problem(f: dataclasses.Field, value: Any) -> str | None:
    """Why `value` does not have the field's type (for configs built in code), or None."""
    kind = kind_of(f)
    if value is None:
        return None if optional(f) else f"must be given ({_expected(f)})"
    if isinstance(value, str) and value in f.metadata.get("words", ()):
        return None
    ok = (
        isinstance(value, bool)
        if kind is bool
        else (
            isinstance(value, kind) and not isinstance(value, bool)
            if kind is not float
            else isinstance(value, (int, float)) and not isinstance(value, bool)
        )
    )
    return None if ok else f"{show(value)} is not {_expected(f)}"


def value_problem(f: dataclasses.Field, value: Any) -> str | None:
    """Why a value of the right type is refused (choices, range, format), or None."""
    if value is None or (isinstance(value, str) and value in f.metadata.get("words", ())):
        return None
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        return f"{show(value)} is not one of {', '.join(choices)}"
    rng = range_of(f)
    if rng is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        problem = rng.problem(value)
        if problem:
            return problem
    if f.metadata.get("path") and isinstance(value, str) and not value.strip():
        return "is empty; give a path"
    check = f.metadata.get("check")
    if check is not None and isinstance(value, str):
        return check(value)
    return None


def parse_number(kind: type, value: Any, *, text: bool = True) -> int | float:
    """`value` as an int or float; ValueError if it is not one. Integral floats are whole numbers (`1e3`).

    `text`: `value` may be command-line text; otherwise it must already be a number (TOML, JSON)."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, str) and text:
        s = value.strip()
        try:
            return int(s) if kind is int else float(s)
        except ValueError:
            value = float(s)  # `1e3` for a whole number; raises ValueError for words
    if not isinstance(value, (int, float)):
        raise ValueError(value)
    if kind is float:
        return float(value)
    if isinstance(value, float):
        if not value.is_integer():  # nan and inf are not integers either
            raise ValueError(value)
        return int(value)
    return value


def coerce(f: dataclasses.Field, value: Any, where: str, *, text: bool = False) -> Any:
    """Convert and check one value where it enters; ConfigError naming `where` (a flag or `section.key`)."""
    kind = kind_of(f)
    words = f.metadata.get("words", ())
    if value is None:
        if optional(f):
            return None
        raise ConfigError(where, f"must be given ({_expected(f)})")
    if isinstance(value, str) and value.strip() in words:
        return value.strip()
    try:
        if kind is bool:
            if isinstance(value, bool):
                converted: Any = value
            elif text and str(value).lower() in ("1", "true", "yes", "on"):
                converted = True
            elif text and str(value).lower() in ("0", "false", "no", "off"):
                converted = False
            else:
                raise ValueError
        elif kind in (int, float):
            converted = parse_number(kind, value, text=text or bool(words))
        elif isinstance(value, str):
            # a path is read once here: `~` expanded (a TOML file has no shell to do it), so what the input
            # checks look at is what the run uses
            converted = os.path.expanduser(value) if f.metadata.get("path") else value
        else:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        if kind is int and isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
            raise ConfigError(where, f"{show(value)} has too many digits; accepted: {range_of(f)}") from None
        accepted = f"; accepted: {range_of(f)}" if range_of(f) else ""
        raise ConfigError(where, f"{show(value)} is not {_expected(f)}{accepted}") from None
    problem = value_problem(f, converted)
    if problem:
        raise ConfigError(where, problem)
    return converted


def number_arg(
    kind: type, low: float | None = None, high: float | None = None, *, low_open: bool = False, high_open: bool = False
) -> Callable[[str], int | float]:
    """An argparse `type=` for a numeric flag that is not a config option (gptop's own: --interval, --nproc),
    converted and range-checked like the config's numbers; a refusal names the value and the range."""
    rng = Range(low, high, low_open, high_open)

    def convert(text: str) -> int | float:
        try:
            value = parse_number(kind, text)
        except (TypeError, ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{show(text)} is not {_TYPE_NAMES[kind]}; accepted: {rng}") from None
        problem = rng.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    convert.__name__ = kind.__name__
    convert.range = rng  # type: ignore[attr-defined]  # what --help and the tests read
    return convert
