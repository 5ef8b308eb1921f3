"""The contract's leaf: what the other contract modules check inputs with, importing none of them.

The error every refused input raises (naming the option), the largest step a run can reach (checkpoint names
hold its digits), the model families a `--model` names, and how a flag and a user's value are written in a
message. The config schema, the input checks, the run-directory layout and its lock all build on these.
"""

from __future__ import annotations

import dataclasses
from typing import Any

STEP_DIGITS = 8
MAX_STEP = 10**STEP_DIGITS - 1  # checkpoint names hold 8 digits: the largest step a run can reach

FAMILIES = ("llama", "deepseek", "llada")


class ConfigError(ValueError):
    """A bad option value. `option` names the flag so the user knows what to fix."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option
        self.message = message


def show(value: Any, limit: int = 60) -> str:
    """`repr(value)` cut to `limit` characters, for error messages about what a user gave."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of a config field (`--micro-batch`), as its metadata names it or from its name."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")
