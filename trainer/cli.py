"""`python -m trainer`: the worker's command line, generated from TrainConfig."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import ConfigError, TrainConfig, add_arguments, config_from_args


def build_parser(prog: str = "python -m trainer") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Train a language model with instrumented steps, exact resume and JSON-line events.",
        )
    add_arguments(parser)
    return parser


def resume_base(resume: str | None) -> TrainConfig | None:
    """The configuration a resumed run starts from: the run directory's config.toml (flags override it)."""
    if not resume:
        return None
    p = Path(resume)
    run_dir = p if p.is_dir() else p.parent.parent
    toml = run_dir / "config.toml"
    if not toml.is_file():
        if not p.exists():
            raise ConfigError("--resume", f"{p} does not exist")
        return None
    cfg = TrainConfig.from_toml(toml)
    cfg.run.run_dir = str(run_dir)
    cfg.checkpoint.resume = None
    cfg.run.channel = None
    cfg.run.fault = None
    return cfg


def parse_config(argv: list[str] | None = None, prog: str = "python -m trainer") -> TrainConfig:
    ns = build_parser(prog).parse_args(argv)
    base = resume_base(getattr(ns, "checkpoint.resume", None))
    return config_from_args(ns, base)


def main(argv: list[str] | None = None) -> int:
    from .train import EXIT_CONFIG, main_run

    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"python -m trainer: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    return main_run(cfg)
