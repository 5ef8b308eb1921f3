"""`python -m trainer`: the worker's command line, generated from TrainConfig."""

from __future__ import annotations

import argparse
import os
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
    """Every input checked where it enters (numbers, files, directories), before a directory is created."""
    ns = build_parser(prog).parse_args(argv)
    base = resume_config(getattr(ns, "checkpoint.resume", None))
    return config_from_args(ns, base, world_size=_launched_world_size())


def _launched_world_size() -> int:
    """The ranks torchrun started (WORLD_SIZE), 1 for a plain process."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def main(argv: list[str] | None = None) -> int:
    from .channel import StartupStopped, install_startup_handlers

    install_startup_handlers()        # a stop while torch imports ends the process cleanly, not by a kill
    try:
        from .train import EXIT_CONFIG, main_run, stopped_in_startup
    except StartupStopped:
        print("[trainer] stopped before the first step", flush=True)
        return 0
    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"python -m trainer: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    code = main_run(cfg)
    if stopped_in_startup():          # the events are written and closed: skip freeing a model tensor by tensor
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
