"""The config on a command line: argparse options generated from the schema, parsed back, and written out.

`add_arguments` adds every option of trainer.contract.config_schema to a parser (flag, help with its default
and range, choices); `config_from_args` builds the TrainConfig from a resumed run's config, a `--config` file
and the typed flags, checking each value where it enters and every path option with trainer.contract.inputs;
`cli_args` is the reverse, the flags that give a config, which is how gptop hands a config to a trainer.
`gptop` and `python -m trainer` both parse with `OneLineParser`.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any, NoReturn

from .common import ConfigError, flag_of
from .config_files import config_from_toml
from .config_options import kind_of, range_of
from .config_schema import SECTIONS, TrainConfig
from .inputs import check_config_paths

EXIT_USAGE = 2  # a bad command line: the exit status of every refusal of an input


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors in one line, as every other refusal: the option, the value and what is
    accepted (argparse's own messages say all three), then where to read more; exit 2. argparse prints the
    whole usage first. `gptop` and `python -m trainer` both parse with it."""

    def error(self, message: str) -> "NoReturn":
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_arguments(parser: argparse.ArgumentParser, sections: tuple[str, ...] = tuple(SECTIONS)) -> None:
    """Add every option of the given sections to `parser`, with its default and range shown in --help.

    Defaults on the parser are SUPPRESS so that `config_from_args` can tell which
    options the user typed (those override `--config`); values are converted and
    checked there, so a flag and the same key in a TOML file get the same checks.
    """
    parser.add_argument(
        "--config",
        metavar="TOML",
        default=argparse.SUPPRESS,
        help="load options from a TOML file (tables per section); flags override it",
    )
    defaults = TrainConfig()
    for section in sections:
        group = parser.add_argument_group(section)
        obj = getattr(defaults, section)
        for f in fields(obj):
            flag = flag_of(f)
            default = getattr(obj, f.name)
            kind = kind_of(f)
            help_text = f.metadata["help"]
            if "default" not in help_text:
                help_text += f" (default: {shown_default(default)}" + (f"; {range_of(f)}" if range_of(f) else "") + ")"
            if f.metadata.get("hidden"):
                help_text = argparse.SUPPRESS
            if kind is bool:
                group.add_argument(
                    flag,
                    dest=f"{section}.{f.name}",
                    action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS,
                    help=help_text,
                )
            else:
                group.add_argument(
                    flag,
                    dest=f"{section}.{f.name}",
                    default=argparse.SUPPRESS,
                    type=str,
                    choices=f.metadata.get("choices"),
                    metavar=f.metadata.get("metavar") or (None if f.metadata.get("choices") else _METAVARS.get(kind)),
                    help=help_text.replace("%", "%%"),
                )


_METAVARS = {int: "N", float: "X", str: "VALUE"}


def shown_default(value: Any) -> str:
    """A default as every --help writes it: on/off for a switch, none for nothing set."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    return "none" if value is None else str(value)


def config_from_args(
    ns: argparse.Namespace, base: TrainConfig | None = None, *, world_size: int = 1, check_paths: bool = True
) -> TrainConfig:
    """Build a TrainConfig: `base` (defaults, or a resumed run's config), then `--config` TOML, then typed flags.

    Every value is checked where it enters, the whole config by `validate`, and every path option by
    `trainer.contract.inputs` (`check_paths`) before anything is started or created.
    Raises ConfigError naming the flag, or the file and key."""
    cfg = base or TrainConfig()
    path = getattr(ns, "config", None)
    if path is not None:
        cfg = config_from_toml(path, cfg)
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(ns).items():
        if "." in key:
            section, name = key.split(".", 1)
            overrides.setdefault(section, {})[name] = value
    flags = {f"{s}.{f.name}": flag_of(f) for s in SECTIONS for f in fields(SECTIONS[s])}
    try:
        cfg = TrainConfig.from_dict(overrides, cfg, text=True)
    except ConfigError as e:
        raise ConfigError(flags.get(e.option, e.option), e.message) from None
    cfg.validate(world_size)
    if check_paths:
        check_config_paths(cfg)
    return cfg


def cli_args(cfg: TrainConfig, base: TrainConfig | None = None, *, full: bool = False) -> list[str]:
    """The flags that turn `base` (defaults) into `cfg`: how gptop passes a config to a trainer process.

    `full` emits every set option, so the result does not depend on what the
    trainer starts from (a resumed run starts from its config.toml)."""
    base = base or TrainConfig()
    args: list[str] = []
    for section in SECTIONS:
        a, b = getattr(cfg, section), getattr(base, section)
        for f in fields(a):
            va, vb = getattr(a, f.name), getattr(b, f.name)
            if va is None or (va == vb and not full):
                continue
            flag = flag_of(f)
            if kind_of(f) is bool:
                args.append(flag if va else "--no-" + flag[2:])
            else:
                args += [flag, str(va)]
    return args
