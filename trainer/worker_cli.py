"""`python -m trainer`: the worker's command line, generated from TrainConfig."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .contract.config import (
    ConfigError,
    OneLineParser,
    TrainConfig,
    add_arguments,
    check_resumable,
    config_from_args,
    resume_config,
)
from .contract import protect
from .contract.rundir import resumes_into
from .contract.runlock import RunLock, lock_option


def build_parser(prog: str = "python -m trainer") -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=prog,
        description="Train a language model with instrumented steps, exact resume and JSON-line events.",
    )
    add_arguments(parser)
    return parser


def parse_config(argv: list[str] | None = None, prog: str = "python -m trainer") -> TrainConfig:
    """Every input checked where it enters (numbers, files, directories), before a directory is created."""
    ns = build_parser(prog).parse_args(argv)
    base = resume_config(getattr(ns, "checkpoint.resume", None))
    cfg = config_from_args(ns, base, world_size=_launched_world_size())
    if base is not None:
        check_resumable(base.to_dict(), cfg, f"the run in {base.run.run_dir}")
    return cfg


def _launched_world_size() -> int:
    """The ranks torchrun started (WORLD_SIZE), 1 for a plain process."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


class UnfailingStream:
    """stdout/stderr that a full or read-only disk cannot turn into a crash: the trainer's output is a log
    file under gptop, and a log line that cannot be written is dropped, not raised in the middle of a step
    (the failure itself is reported by the write that matters: a checkpoint, an event)."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


EXIT_CONFIG = 2  # trainer.train.EXIT_CONFIG, without importing torch


def main(argv: list[str] | None = None) -> int:
    sys.stdout, sys.stderr = UnfailingStream(sys.stdout), UnfailingStream(sys.stderr)
    from .channel import StartupStopped, install_startup_handlers

    install_startup_handlers()  # a stop while torch imports ends the process cleanly, not by a kill
    try:
        cfg = parse_config(argv)
        # One writer per run directory, and one run: refused at once, before torch is imported (a default run
        # directory is new: the trainer locks it when it has named it).
        created = protect.dirs_to_create(cfg.run.run_dir) if cfg.run.run_dir else []  # a refusal removes them
        lock = (
            RunLock.for_trainer(
                cfg.run.run_dir,
                new_run=not resumes_into(cfg.checkpoint.resume, cfg.run.run_dir),
                option=lock_option(cfg.checkpoint.resume, cfg.run.run_dir),
            )
            if cfg.run.run_dir
            else None
        )
    except ConfigError as e:
        print(f"python -m trainer: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        from .runner import main_run
    except StartupStopped:
        print("[trainer] stopped before the first step", flush=True)
        return 0
    return main_run(cfg, run_lock=lock, created_dirs=created)
