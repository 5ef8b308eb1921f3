"""A config read from a TOML file: `--config`, best.toml, a run directory's config.toml.

The file is checked as every path a user gives (trainer.contract.inputs: it exists, is a small UTF-8 file,
is TOML) before its tables are read by the schema; an error names the option, the file and the key.
Writing one is `TrainConfig.to_toml` (the text; the run writes it atomically).
"""

from __future__ import annotations

from pathlib import Path

from .common import ConfigError
from .config_schema import TrainConfig
from .inputs import check_resume, read_toml
from .rundir import CONFIG as RUN_CONFIG
from .rundir import run_dir_of


def config_from_toml(path: str | Path, base: TrainConfig | None = None, *, option: str = "--config") -> TrainConfig:
    """Load a TOML file (`--config`, best.toml, a run's config.toml) over `base` (defaults); errors name
    `option`, the file and key."""
    data = read_toml(path, option)
    try:
        return TrainConfig.from_dict(data, base)
    except ConfigError as e:
        raise ConfigError(f"{option} {path}", f"{e.option}: {e.message}") from None


def resume_config(target: str | None) -> TrainConfig | None:
    """The configuration a resumed run starts from: its run directory's config.toml (flags override it).

    `target` is a run directory or a checkpoint in one (checked by trainer.contract.inputs: a ConfigError
    if there is nothing to resume); None when its run directory has no config.toml."""
    if not target:
        return None
    run_dir = run_dir_of(check_resume(target))
    toml = run_dir / RUN_CONFIG
    if not toml.exists():
        return None
    cfg = config_from_toml(toml, option="--resume")
    cfg.run.run_dir = str(run_dir)
    cfg.checkpoint.resume = None
    cfg.run.channel = None
    cfg.run.fault = None
    return cfg
