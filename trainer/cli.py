"""`python -m trainer`: the worker's command line, generated from TrainConfig."""

from __future__ import annotations

import argparse
import sys

from .contract.config import ConfigError, TrainConfig, add_arguments, config_from_args
from .contract.rundir import resume_config


def build_parser(prog: str = "python -m trainer") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Train a language model with instrumented steps, exact resume and JSON-line events.",
        )
    add_arguments(parser)
    return parser


def parse_config(argv: list[str] | None = None, prog: str = "python -m trainer") -> TrainConfig:
    ns = build_parser(prog).parse_args(argv)
    base = resume_config(getattr(ns, "checkpoint.resume", None))
    return config_from_args(ns, base)


def main(argv: list[str] | None = None) -> int:
    from .train import EXIT_CONFIG, main_run

    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"python -m trainer: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    return main_run(cfg)
