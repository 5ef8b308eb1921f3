"""Old layouts of a stored config, read as today's: options that moved to another section.

A TOML file (`--config`, best.toml), a run's config.toml or a checkpoint's stored config written before an
option moved still reads: `current_layout` puts every moved option in the section that holds it now, before
the schema (trainer.contract.config_schema) reads the tables.
"""

from __future__ import annotations

from typing import Any

from .common import ConfigError, show

# Options that moved to another section: (old section, key) -> the section that holds them now. A TOML file,
# a run's config.toml or a checkpoint's stored config that has them at the old place still reads.
MOVED: dict[tuple[str, str], str] = {("optim", "optimizer"): "toggles", ("finetune", "quantize_base"): "toggles"}


def current_layout(d: dict[str, Any]) -> dict[str, Any]:
    """`d` (tables of options) with every moved option (`MOVED`) in its current section; ConfigError naming both
    places when a file gives one option twice with different values."""
    if not any(isinstance(d.get(sec), dict) and key in d[sec] for sec, key in MOVED):
        return d
    out = {sec: (dict(v) if isinstance(v, dict) else v) for sec, v in d.items()}
    for (sec, key), home in MOVED.items():
        table = out.get(sec)
        if not isinstance(table, dict) or key not in table:
            continue
        value = table.pop(key)
        target = out.setdefault(home, {})
        if not isinstance(target, dict):
            continue  # from_dict names the bad table
        if key in target and target[key] != value:
            raise ConfigError(
                f"{sec}.{key}",
                f"{show(value)} conflicts with {home}.{key} = {show(target[key])}; "
                f"{key} belongs in [{home}] now: keep that one",
            )
        target.setdefault(key, value)
    return out
